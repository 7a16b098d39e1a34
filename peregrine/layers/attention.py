"""The Attention layer: stores the new K/V into its paged cache and attends, via a backend."""
from __future__ import annotations

import torch
from torch import nn

from peregrine.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Paged attention for one decoder layer. The backend and metadata are passed in, never global.

    k_scale / v_scale: the cache holds k / k_scale and v / v_scale (1.0 for 16/32-bit caches).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend, sliding_window: int | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding window must be >= 1, got {sliding_window}")
        if k_scale <= 0 or v_scale <= 0:
            raise ValueError(f"k_scale and v_scale must be > 0, got {k_scale}, {v_scale}")
        self.sliding_window = sliding_window  # None: full causal attention
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_scale = float(k_scale)
        self.v_scale = float(v_scale)
        self.backend = backend

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
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                                   out=out, window=self.sliding_window, k_scale=self.k_scale,
                                   v_scale=self.v_scale)  # (T, Hq, D)
        return out.reshape(t, self.num_heads * self.head_dim)

    def store(self, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
              slot_mapping: torch.Tensor) -> None:
        """Write k, v (T, Hkv, D) into the paged cache at slot_mapping (T,); -1 writes nothing."""
        self.backend.store_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping,
                              k_scale=self.k_scale, v_scale=self.v_scale)
