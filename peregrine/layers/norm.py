"""RMSNorm with an optional fused residual add."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = w * x / rms(x); with `residual`, x := x + residual first and the new residual is returned."""

    def __init__(self, hidden: int, eps: float = 1e-6, *, dtype: torch.dtype,
                 fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.use_fused = fused  # the Triton kernel (chosen when the model is built)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                residual_out: torch.Tensor | None = None):
        """norm(x), or (norm(x + residual), x + residual) with the sum written into
        residual_out when given (a fixed buffer: piecewise CUDA graphs)."""
        if self.use_fused:
            from peregrine.kernels.rmsnorm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual, residual_out)
        if residual is not None:
            x = x + residual
            residual = x if residual_out is None else residual_out.copy_(x)
        # NOTE: same op order as transformers (normalize in fp32, cast, then scale) so fp32 matches.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(x.dtype)
        return out if residual is None else (out, residual)
