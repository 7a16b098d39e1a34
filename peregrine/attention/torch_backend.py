"""Pure-torch attention backend: the reference (oracle) and the CPU path."""
from __future__ import annotations

import torch

from peregrine.attention.backend import AttentionBackend
from peregrine.attention.metadata import AttentionMetadata
from peregrine.kernels.reference import paged_attention_ref, store_kv_ref


class TorchAttentionBackend(AttentionBackend):
    """Stores K/V with index_put, then loops over sequences (vectorised within each one); an FP8
    cache is dequantized to fp32 as it is gathered."""

    name = "torch"

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, out: torch.Tensor | None,
               window: int | None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        if out is None:
            out = torch.zeros_like(q, memory_format=torch.contiguous_format)  # (T, Hq, D)
        else:
            out.zero_()
        # NOTE: prefer the host copies; falling back to the device tensors costs a sync.
        seq_lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens
        qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None \
            else meta.query_start_loc
        # NOTE: q . (k_scale * k) = (k_scale * q) . k, and the softmax-weighted sum is linear in v.
        out = paged_attention_ref(q, k_cache, v_cache, meta.block_table, seq_lens, qsl,
                                  scale * k_scale, out=out, window=window)
        return out if v_scale == 1.0 else out.mul_(v_scale)
