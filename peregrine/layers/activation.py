"""SiLU-and-mul for gated MLPs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x (T, 2I) -> silu(x[:, :I]) * x[:, I:]  (T, I)."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.use_fused = fused  # the Triton kernel (chosen when the model is built)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_fused:
            from peregrine.kernels.activation import silu_and_mul
            return silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
