"""Qwen3: per-head RMSNorm of q and k before RoPE, explicit head_dim, Qwen2's window rule."""
from __future__ import annotations

from typing import Any

import torch

from peregrine.layers.norm import RMSNorm
from peregrine.layers.rotary import RotaryEmbedding
from peregrine.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderParts
from peregrine.models.protocol import BuildOptions
from peregrine.models.qwen2 import qwen_windows


class Qwen3Attention(DecoderAttention):
    def __init__(self, hf: dict[str, Any], rope: RotaryEmbedding, opts: BuildOptions, prefix: str,
                 window: int | None = None) -> None:
        super().__init__(hf, rope, opts, prefix, window)
        eps = hf.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps, dtype=opts.dtype, fused=opts.kernels.fused)
        self.k_norm = RMSNorm(self.head_dim, eps, dtype=opts.dtype, fused=opts.kernels.fused)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # (T, Hq, D), (T, Hkv, D)

    def qk_norm_params(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps


class Qwen3ForCausalLM(DecoderForCausalLM):
    parts = DecoderParts(attention=Qwen3Attention)

    @classmethod
    def default_windows(cls, hf: dict[str, Any], window: int, n: int) -> list[int | None]:
        return qwen_windows(hf, window, n)
