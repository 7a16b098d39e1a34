"""SiLU-and-mul for gated MLPs: silu(x[..., :I]) * x[..., I:]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from peregrine.kernels._utils import pdl_args, pdl_release, pdl_wait, release_before_gemv


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in float32 (the one expression every kernel that fuses it uses)."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter,
                         BLOCK: tl.constexpr, PDL: tl.constexpr, RELEASE: tl.constexpr = False):
    pdl_release(RELEASE)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out = silu_mul(gate, up)  # (BLOCK,)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2I) -> silu(x[..., :I]) * x[..., I:] of shape (..., I)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim {x.shape[-1]} is not even")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)  # (N, 2I)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)  # (N, I)
    block = 1024
    if x2.shape[0] > 0 and inter > 0:
        pdl = pdl_args(x2)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4,
            RELEASE=release_before_gemv(pdl, x2.shape[0]), **pdl)
    return out.view(*x.shape[:-1], inter)
