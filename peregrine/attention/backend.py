"""The attention backend interface: store the new K/V, then attend over the paged cache."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from peregrine import envs
from peregrine.attention.metadata import AttentionMetadata

BACKEND_NAMES = ("torch", "triton")


class AttentionBackend(ABC):
    """Paged causal attention for one layer and one flat step batch (decodes first).

    k_scale / v_scale: the cache holds k / k_scale and v / v_scale (saturated to the finite range
    in an FP8 cache); attention reads them back multiplied. The Attention layer passes 1.0 for
    16/32-bit caches.
    """

    name: str = "abstract"

    def __init__(self) -> None:
        # NOTE: read once: the shape checks cost host time on every layer of every step.
        self.debug_checks = envs.debug_checks()

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, out: torch.Tensor | None = None, window: int | None = None,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """Store k/v (T, Hkv, D) at meta.slot_mapping, then return attention of q (T, Hq, D),
        written into `out` (T, Hq, D) when given. Rows past meta.num_actual_tokens are zeros.
        k = v = None: the step's K/V are already stored (by store_kv). With a sliding window, a
        query at position p sees keys p - window + 1 .. p. Shapes are checked only with
        PEREGRINE_DEBUG_CHECKS=1."""
        if self.debug_checks:
            check_shapes(q, k, v, k_cache, v_cache, meta, out)
            if window is not None and window < 1:
                raise ValueError(f"sliding window must be >= 1, got {window}")
        if k is not None:
            self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return self.attend(q, k_cache, v_cache, meta, scale, out, window, k_scale, v_scale)

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        """Write k / k_scale, v / v_scale (T, Hkv, D) into the paged caches at slot_mapping (T,);
        -1 writes nothing."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, out: torch.Tensor | None,
               window: int | None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """Attention of q (T, Hq, D) over the stored paged context (shapes already checked)."""


def check_shapes(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 out: torch.Tensor | None = None) -> None:
    """Raise ValueError when the step tensors do not fit together (cheap: shapes only).
    k = v = None (already stored) checks the caches against q alone."""
    if q.dim() != 3:
        raise ValueError(f"expected q (T, Hq, D), got {tuple(q.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    if (k is None) != (v is None):
        raise ValueError("k and v must both be given or both be None (already stored)")
    if k is not None:
        if k.dim() != 3 or k.shape != v.shape:
            raise ValueError(f"expected k/v (T, Hkv, D); got k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)}")
        if k.shape[0] != num_tokens or k.shape[2] != head_dim:
            raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on T or D")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim or (
            k is not None and k_cache.shape[2] != k.shape[1]):
        kv_heads = k.shape[1] if k is not None else "Hkv"
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be "
                         f"(num_blocks, block_size, {kv_heads}, {head_dim})")
    if num_q_heads % k_cache.shape[2]:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads "
                         f"{k_cache.shape[2]}")
    if meta.slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(meta.slot_mapping.shape)} != ({num_tokens},)")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} "
                         f"{q.dtype} and be contiguous in its last dim")
    if meta.num_decodes > meta.num_seqs or meta.num_decodes > num_tokens:
        raise ValueError(f"num_decodes {meta.num_decodes} exceeds {meta.num_seqs} sequences or "
                         f"{num_tokens} tokens")


def get_attention_backend(name: str) -> AttentionBackend:
    """A fresh backend by name: "torch" (reference, any device) or "triton" (GPU kernels)."""
    # NOTE: imports are lazy so that the torch backend never imports triton.
    if name == "torch":
        from peregrine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "triton":
        from peregrine.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (expected one of {BACKEND_NAMES})")
