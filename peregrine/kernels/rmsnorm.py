"""Fused RMSNorm with optional residual add (one program per row)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from peregrine.kernels._utils import (next_pow2, pdl_args, pdl_release, pdl_wait,
                                      release_before_gemv)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, eps,
    stride_x, stride_res, stride_out, stride_new_res,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
    RELEASE: tl.constexpr = False,
):
    pdl_release(RELEASE)
    offs = tl.arange(0, BLOCK)  # (BLOCK,)
    mask = offs < HIDDEN
    # NOTE: the weight is constant, so it is read before waiting for the kernel before (a
    # dependent launch): its load overlaps that kernel's tail instead of following the sum.
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK,)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK,)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        # NOTE: round the sum to the activation dtype first, as the unfused model does, so the
        # residual stream and the normalised value match it bit for bit.
        summed = (x + r).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_new_res + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    var = tl.sum(x * x, 0) / HIDDEN
    normed = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)  # (BLOCK,)
    tl.store(out_ptr + row * stride_out + offs, (normed * w).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x (..., H); with residual returns (norm(x + residual),
    x + residual), the sum written into residual_out (shaped like x) when given."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match hidden {hidden}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    x2 = x.reshape(-1, hidden)  # (N, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)  # (N, H)
    res2 = new_res = out
    if residual is not None:
        res2 = residual.reshape(-1, hidden)  # (N, H)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        new_res = torch.empty_like(out) if residual_out is None \
            else _out_rows(residual_out, x.shape)  # (N, H)
    if x2.shape[0] > 0:
        pdl = pdl_args(x2)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, new_res, eps,
            x2.stride(0), res2.stride(0), out.stride(0), new_res.stride(0),
            HIDDEN=hidden, BLOCK=next_pow2(hidden), HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, next_pow2(hidden) // 256)),
            RELEASE=release_before_gemv(pdl, x2.shape[0]), **pdl,
        )
    out = out.view(x.shape)
    if residual is None:
        return out
    return out, new_res.view(x.shape) if residual_out is None else residual_out


def _out_rows(out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """out (shaped like x) as (N, H) rows the kernel writes through; ValueError if it cannot."""
    if out.shape != shape or out.stride(-1) != 1:
        raise ValueError(f"rms_norm: residual_out {tuple(out.shape)} must be shaped like x "
                         f"{tuple(shape)} and contiguous in its last dim")
    try:
        return out.view(-1, shape[-1])
    except RuntimeError:
        raise ValueError("rms_norm: residual_out's rows must be one stride apart") from None
