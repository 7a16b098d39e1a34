"""Triton attention backend: store_kv, flash-decoding for decodes, paged flash attention for the
prefill/extend chunks."""
from __future__ import annotations

import torch

from peregrine.attention.backend import AttentionBackend
from peregrine.attention.metadata import AttentionMetadata
from peregrine.kernels.decode_attention import paged_decode_attention
from peregrine.kernels.extend_attention import extend_attention
from peregrine.kernels.store_kv import store_kv


class TritonAttentionBackend(AttentionBackend):
    """Decode kernel on sequences [0, num_decodes), extend kernel on the rest."""

    name = "triton"
    # Mixed steps with at most this many decodes run them in the extend kernel (see forward).
    fold_decodes_max = 8

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, out: torch.Tensor | None,
               window: int | None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        num_tokens = q.shape[0]
        num_decodes = meta.num_decodes
        # NOTE: launches are reused only into a caller's fixed output buffer (piecewise graphs):
        # with a fresh output per layer nothing would match, and the dict would keep every
        # layer's q and output alive until the step ends.
        launches = meta.launches if out is not None else None
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (T, Hq, D)
        has_chunks = meta.num_seqs > num_decodes
        if has_chunks and num_decodes <= self.fold_decodes_max:
            # NOTE: a few decodes beside a chunk ride in the extend kernel as 1-token chunks: two
            # launches fewer per layer (host time a light-load step is bound by) for a little
            # more K/V traffic, which the L2 absorbs at this size.
            num_decodes = 0
        if num_decodes > 0:
            # NOTE: decode token i belongs to sequence i (decodes come first, one token each).
            paged_decode_attention(q[:num_decodes], k_cache, v_cache,
                                   meta.block_table[:num_decodes], meta.seq_lens[:num_decodes],
                                   scale, out=out[:num_decodes], window=window,
                                   k_scale=k_scale, v_scale=v_scale,
                                   launches=launches if has_chunks else None)
        if has_chunks:
            extend_attention(q, k_cache, v_cache, meta.block_table, meta.seq_lens,
                             meta.query_start_loc, scale, meta.max_query_len, out=out,
                             seq_start=num_decodes, window=window, k_scale=k_scale,
                             v_scale=v_scale, launches=launches)
            covered = meta.num_actual_tokens
        else:
            # NOTE: decode-only batches (the CUDA-graph case) read no host metadata at all.
            covered = num_decodes
        if covered < num_tokens and not meta.out_padding_zeroed:
            out[covered:].zero_()  # padding rows: defined values, nothing stored for them
        return out
