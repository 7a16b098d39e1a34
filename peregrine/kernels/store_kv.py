"""Scatter the new tokens' K/V into the paged cache (one program per token), scaled and
saturated for an FP8 cache."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from peregrine.kernels._utils import check_block_size, is_gpu, next_pow2
from peregrine.kernels.reference import FP8_DTYPES


@triton.jit
def _fp8_bits(x, MANT: tl.constexpr, BIAS: tl.constexpr, MAGIC: tl.constexpr,
              MIN_NORMAL: tl.constexpr):
    """The FP8 bit pattern (uint8) of fp32 x with |x| <= the format's max, rounded to nearest
    even, from integer and fp32 arithmetic alone."""
    u = x.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    mag = u & 0x7FFFFFFF
    a = mag.to(tl.float32, bitcast=True)
    # Normal range: round the fp32 mantissa to MANT bits (ties to even, a carry moves into the
    # exponent), then rebias the exponent.
    shift = 23 - MANT
    rounded = (mag + ((1 << (shift - 1)) - 1) + ((mag >> shift) & 1)) >> shift
    normal = rounded - ((127 - BIAS) << MANT)
    # Below the smallest normal: MAGIC's ulp is the FP8 subnormal step, so the fp32 add rounds
    # to it (nearest even) and the low bits are the FP8 subnormal's mantissa.
    magic_bits = tl.full(x.shape, MAGIC, tl.float32).to(tl.uint32, bitcast=True)
    sub = (a + MAGIC).to(tl.uint32, bitcast=True) - magic_bits
    bits = tl.where(a < MIN_NORMAL, sub, normal)
    return (tl.where(x != x, 0x7F, bits) | sign).to(tl.uint8)


@triton.jit
def _quantize(x, inv_scale, out_ty, FP8_MAX: tl.constexpr, SOFT_FP8: tl.constexpr,
              MANT: tl.constexpr, BIAS: tl.constexpr, MAGIC: tl.constexpr,
              MIN_NORMAL: tl.constexpr):
    """x * inv_scale in fp32, saturated to +-FP8_MAX when it is > 0, in the cache's type."""
    y = x.to(tl.float32) * inv_scale
    if FP8_MAX > 0:
        # NOTE: a NaN stays NaN (as in a 16-bit cache) rather than becoming +-FP8_MAX.
        y = tl.minimum(tl.maximum(y, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
    if SOFT_FP8:
        return _fp8_bits(y, MANT, BIAS, MAGIC, MIN_NORMAL)
    return y.to(out_ty)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, inv_k_scale, inv_v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP8_MAX: tl.constexpr, SOFT_FP8: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    MAGIC: tl.constexpr, MIN_NORMAL: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)  # (BH,)
    offs_d = tl.arange(0, BLOCK_D)  # (BD,)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)  # (BH, BD)
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mask)  # (BH, BD)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask)  # (BH, BD)
    kc = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s
    vc = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s
    kq = _quantize(k, inv_k_scale, k_cache_ptr.dtype.element_ty, FP8_MAX, SOFT_FP8, MANT, BIAS,
                   MAGIC, MIN_NORMAL)  # (BH, BD)
    vq = _quantize(v, inv_v_scale, v_cache_ptr.dtype.element_ty, FP8_MAX, SOFT_FP8, MANT, BIAS,
                   MAGIC, MIN_NORMAL)  # (BH, BD)
    tl.store(kc + offs_h[:, None] * stride_kc_h + offs_d[None, :], kq, mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vc_h + offs_d[None, :], vq, mask=mask)


def _fp8_constants(dtype: torch.dtype) -> dict:
    """The FP8 format's constexprs (FP8_MAX = 0 for a 16/32-bit cache: no saturation)."""
    if dtype not in FP8_DTYPES:
        return dict(FP8_MAX=0.0, MANT=0, BIAS=0, MAGIC=0.0, MIN_NORMAL=0.0)
    mant, bias = (3, 7) if dtype == torch.float8_e4m3fn else (2, 15)
    return dict(FP8_MAX=float(torch.finfo(dtype).max), MANT=mant, BIAS=bias,
                MAGIC=2.0 ** (24 - bias - mant), MIN_NORMAL=2.0 ** (1 - bias))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write k / k_scale, v / v_scale (T, Hkv, D) into k_cache/v_cache (num_blocks, block_size,
    Hkv, D) at slot_mapping (T,), saturated to the finite range for an FP8 cache; slots < 0 are
    skipped."""
    num_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"slot_mapping {tuple(slot_mapping.shape)} do not match")
    if k_cache.shape[2:] != (num_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"store_kv: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not "
                         f"fit k {tuple(k.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"store_kv: k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ")
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"store_kv: k_scale and v_scale must be > 0, got {k_scale}, {v_scale}")
    check_block_size(k_cache.shape[1])
    # NOTE: the head dim is addressed with unit stride, so only the last dim must be contiguous.
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"store_kv: {name} must be contiguous in its last dim")
    if num_tokens == 0:
        return
    consts = _fp8_constants(k_cache.dtype)
    # NOTE: the GPU converts with the hardware's saturating round-to-nearest-even; Triton's CPU
    # interpreter rounds fp32 -> fp8 wrongly (no ties-to-even, a mantissa carry is lost), so there
    # the kernel builds the same bits itself and writes them through a uint8 view.
    soft = k_cache.dtype in FP8_DTYPES and not is_gpu(k_cache)
    if soft:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim), BLOCK_SIZE=k_cache.shape[1],
        SOFT_FP8=soft, **consts,
    )
