"""The Attention layer: stores the new K/V into its paged cache and attends, via a backend."""
from __future__ import annotations

import math

import torch
from torch import nn

from peregrine.attention.kv_dtype import is_fp8
from peregrine.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Paged attention for one decoder layer. The backend and metadata are passed in, never global.

    k_scale / v_scale: the per-tensor scales of an FP8 cache, which holds k / k_scale and
    v / v_scale (from the checkpoint when it has them, else 1.0). A 16/32-bit cache holds k and v
    as they are and ignores them.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend, sliding_window: int | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window  # None: full causal attention
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_scale = self.v_scale = 1.0
        self.set_kv_scale("k", k_scale)
        self.set_kv_scale("v", v_scale)
        self.backend = backend

    def set_kv_scale(self, which: str, value: float, source: str = "") -> None:
        """Set the K ("k") or V ("v") cache scale; ValueError unless finite and > 0."""
        value = float(value)
        if not (math.isfinite(value) and value > 0):
            where = f" ({source})" if source else ""
            raise ValueError(f"{which}_scale must be finite and > 0, got {value}{where}")
        if which == "k":
            self.k_scale = value
        elif which == "v":
            self.v_scale = value
        else:
            raise ValueError(f"which must be 'k' or 'v', got {which!r}")

    def cache_scales(self, cache: torch.Tensor) -> tuple[float, float]:
        """(k_scale, v_scale) for a cache of cache's dtype: the layer's for FP8, else 1.0."""
        # NOTE: a host-side dtype check; the scales are plain floats, so a CUDA graph captures
        # them as kernel arguments, the same values every replay.
        return (self.k_scale, self.v_scale) if is_fp8(cache.dtype) else (1.0, 1.0)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention (T, Hq * D) of q (T, Hq, D) given k, v (T, Hkv, D), or k = v = None when
        store() already wrote them; written into `out` (T, Hq, D) when given (a fixed buffer
        for CUDA graphs)."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)  # (T, Hq, D)
        if k is not None:
            k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
            v = v.view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        k_scale, v_scale = self.cache_scales(kv_cache[0])
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                                   out=out, window=self.sliding_window, k_scale=k_scale,
                                   v_scale=v_scale)  # (T, Hq, D)
        return out.reshape(t, self.num_heads * self.head_dim)

    def store(self, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
              slot_mapping: torch.Tensor) -> None:
        """Write k, v (T, Hkv, D) into the paged cache at slot_mapping (T,); -1 writes nothing."""
        k_scale, v_scale = self.cache_scales(kv_cache[0])
        self.backend.store_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping,
                              k_scale=k_scale, v_scale=v_scale)
