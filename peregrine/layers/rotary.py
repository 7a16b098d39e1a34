"""Rotary position embedding (neox / rotate-half layout), default and llama3 frequency scaling."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_parameters(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from a config.json, old (`rope_theta`/`rope_scaling`) or new (`rope_parameters`) style."""
    params = hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q (T, Hq, D) and k (T, Hkv, D) at integer `positions` (T,)."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None, fused: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv = _inv_freq(head_dim, theta, scaling)  # (D/2,)
        pos = torch.arange(max_position, dtype=torch.int64).float()
        freqs = pos[:, None] * inv[None, :]  # (P, D/2)
        # cos and sin halves side by side: (P, D)
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1),
                             persistent=False)
        self.use_fused = fused  # the Triton kernel (chosen when the model is built)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.use_fused:
            from peregrine.kernels.rotary import apply_rope
            return apply_rope(q, k, positions, self.cos_sin_cache)
        half = self.head_dim // 2
        cs = self.cos_sin_cache.index_select(0, positions)  # (T, D)
        cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1).unsqueeze(1).to(q.dtype)  # (T, 1, D)
        sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1).unsqueeze(1).to(q.dtype)  # (T, 1, D)
        return _rotate(q, cos, sin, half), _rotate(k, cos, sin, half)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (T, H, D)
    return x * cos + rotated * sin
