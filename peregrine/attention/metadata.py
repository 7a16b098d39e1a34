"""Attention metadata for one flat step batch, passed explicitly to every Attention layer."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Describes B sequences packed into T tokens.

    The batch is ordered decodes first: sequences [0, num_decodes) have exactly one new token,
    the rest are prefill/extend chunks (a chunk may start after a cached or computed prefix).
    """

    num_actual_tokens: int  # T without CUDA-graph padding
    num_decodes: int  # leading sequences with query length 1
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # (B + 1,) int32, device: token offsets of each sequence
    seq_lens: torch.Tensor  # (B,) int32, device: context length including the new tokens
    block_table: torch.Tensor  # (B, max_blocks) int32, device: physical block ids
    slot_mapping: torch.Tensor  # (T,) int64, device: block_id * block_size + offset; -1 = skip
    # Host copies (the torch backend and the prefill kernel's launch grid read these).
    query_start_loc_cpu: torch.Tensor | None = None  # (B + 1,) int32
    seq_lens_cpu: torch.Tensor | None = None  # (B,) int32
    # The caller zeroed the output's padding rows (past num_actual_tokens) for the whole step:
    # layers after the first need not (piecewise graphs share one output buffer across layers).
    out_padding_zeroed: bool = False
    # Kernel launches prepared by this step's first layer for the others to reuse (a backend's
    # to fill; see kernels/extend_attention.py).
    launches: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

