"""The attention layer's step between the qkv projection and attention, in one launch: per-head
RMSNorm of q and k (Qwen3; optional), RoPE, q rotated in place, k and v written straight into the
paged cache (scaled and saturated for an FP8 cache). It replaces RMSNorm x2 (with the copies a
strided q/k needs), RoPE and store_kv."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from peregrine.kernels._utils import (check_block_size, early_step_inputs, is_gpu, next_pow2,
                                      pdl_args, pdl_release, pdl_wait, release_rope_store)
from peregrine.kernels.reference import FP8_DTYPES
from peregrine.kernels.store_kv import _fp8_constants, _quantize


@triton.jit
def _norm_rope(x1, x2, w_ptr, cos, sin, eps, offs_r, r_mask, out_ty,
               HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """RoPE of heads given as fp32 halves x1, x2 (BH, BR), RMS-normalised first when HAS_NORM;
    the normalised value is rounded to out_ty as the unfused RMSNorm stores it."""
    if HAS_NORM:
        var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)  # (BH,)
        inv = tl.rsqrt(var + eps)[:, None]  # (BH, 1)
        w1 = tl.load(w_ptr + offs_r, mask=r_mask, other=0.0).to(tl.float32)  # (BR,)
        w2 = tl.load(w_ptr + HALF + offs_r, mask=r_mask, other=0.0).to(tl.float32)  # (BR,)
        x1 = ((x1 * inv).to(out_ty).to(tl.float32) * w1[None, :]).to(out_ty).to(tl.float32)
        x2 = ((x2 * inv).to(out_ty).to(tl.float32) * w2[None, :]).to(out_ty).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]  # (BH, BR)
    out2 = x2 * cos[None, :] + x1 * sin[None, :]  # (BH, BR)
    return out1, out2


@triton.jit
def _norm_rope_store_kernel(
    q_ptr, q_out_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr, eps, inv_k_scale, inv_v_scale,
    stride_qt, stride_qh, stride_qot, stride_qoh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_GROUPS: tl.constexpr,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
    FP8_MAX: tl.constexpr, SOFT_FP8: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    MAGIC: tl.constexpr, MIN_NORMAL: tl.constexpr, PDL: tl.constexpr,
    RELEASE: tl.constexpr = False, EARLY: tl.constexpr = False,
):
    pdl_release(RELEASE)
    if not EARLY:
        pdl_wait(PDL)
    # Grid (T, Q_GROUPS + KV groups): a program takes BLOCK_H q heads, or BLOCK_H k and v heads.
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    # NOTE: with EARLY the position, its table rows and the slot (step inputs and a constant
    # table) are read before the wait; q, k and v after it.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)  # (BR,)
    r_mask = offs_r < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_r, mask=r_mask,
                  other=0.0).to(tl.float32)  # (BR,)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if EARLY:
        pdl_wait(PDL)
    offs_h = tl.arange(0, BLOCK_H)  # (BH,)
    if g < Q_GROUPS:
        heads = g * BLOCK_H + offs_h  # (BH,)
        mask = (heads[:, None] < NUM_Q_HEADS) & r_mask[None, :]  # (BH, BR)
        p1 = q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_r[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)  # (BH, BR)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)  # (BH, BR)
        o1, o2 = _norm_rope(x1, x2, qw_ptr, cos, sin, eps, offs_r, r_mask,
                            q_ptr.dtype.element_ty, HALF, HAS_NORM)
        po = q_out_ptr + t * stride_qot + heads[:, None] * stride_qoh + offs_r[None, :]
        tl.store(po, o1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(po + HALF, o2.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        heads = (g - Q_GROUPS) * BLOCK_H + offs_h  # (BH,)
        # NOTE: a padding token (slot -1) has no live heads: it loads and stores nothing.
        live = tl.where(slot >= 0, NUM_KV_HEADS, 0)
        mask = (heads[:, None] < live) & r_mask[None, :]  # (BH, BR)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        pk = k_ptr + t * stride_kt + heads[:, None] * stride_kh + offs_r[None, :]
        x1 = tl.load(pk, mask=mask, other=0.0).to(tl.float32)  # (BH, BR)
        x2 = tl.load(pk + HALF, mask=mask, other=0.0).to(tl.float32)  # (BH, BR)
        # NOTE: v is read with k, before the cache stores (which the compiler may not move loads
        # above), so the program waits on one round of loads, not two.
        pv = v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs_r[None, :]
        v1 = tl.load(pv, mask=mask)  # (BH, BR)
        v2 = tl.load(pv + HALF, mask=mask)  # (BH, BR)
        k1, k2 = _norm_rope(x1, x2, kw_ptr, cos, sin, eps, offs_r, r_mask,
                            k_ptr.dtype.element_ty, HALF, HAS_NORM)
        # NOTE: k is rounded to the activation dtype before it is quantized, as the unfused
        # path stores it, so both write the same cache bytes.
        k1 = k1.to(k_ptr.dtype.element_ty)
        k2 = k2.to(k_ptr.dtype.element_ty)
        kc = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s \
            + heads[:, None] * stride_kc_h + offs_r[None, :]
        ty = k_cache_ptr.dtype.element_ty
        tl.store(kc, _quantize(k1, inv_k_scale, ty, FP8_MAX, SOFT_FP8, MANT, BIAS, MAGIC,
                               MIN_NORMAL), mask=mask)
        tl.store(kc + HALF, _quantize(k2, inv_k_scale, ty, FP8_MAX, SOFT_FP8, MANT, BIAS, MAGIC,
                                      MIN_NORMAL), mask=mask)
        vc = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s \
            + heads[:, None] * stride_vc_h + offs_r[None, :]
        tl.store(vc, _quantize(v1, inv_v_scale, ty, FP8_MAX, SOFT_FP8, MANT, BIAS, MAGIC,
                               MIN_NORMAL), mask=mask)
        tl.store(vc + HALF, _quantize(v2, inv_v_scale, ty, FP8_MAX, SOFT_FP8, MANT, BIAS, MAGIC,
                                      MIN_NORMAL), mask=mask)


def heads_per_program(head_dim: int, num_heads: int) -> int:
    """Heads one program takes: about 512 elements a tile, no more heads than there are."""
    return max(1, min(next_pow2(num_heads), 512 // next_pow2(head_dim)))


def norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                    eps: float = 1e-6, q_out: torch.Tensor | None = None,
                    gemv_projections: bool = False) -> torch.Tensor:
    """RoPE q (T, Hq, D) in place (into q_out when given) and write RoPE'd k / k_scale and
    v / v_scale (T, Hkv, D) into k_cache / v_cache (num_blocks, block_size, Hkv, D) at
    slot_mapping (T,) (slots < 0 are skipped); with q_weight and k_weight (D,), q and k are
    RMS-normalised per head first. k and v themselves are left as they are. Returns the new q.
    gemv_projections: the layer's projections are GEMVs launched as dependents (its quantization
    method's `dependent_launches`); at small decode batches this kernel then lets the decode
    split kernel be scheduled at its start (_utils.release_rope_store)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"norm_rope_store: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)} do not match")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"norm_rope_store: positions {tuple(positions.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} must be ({num_tokens},)")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or head_dim % 2:
        raise ValueError(f"norm_rope_store: cos_sin_cache {tuple(cos_sin_cache.shape)} must "
                         f"rotate the whole head (head_dim {head_dim}, even)")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"norm_rope_store: caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} do not fit k {tuple(k.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"norm_rope_store: k_cache {k_cache.dtype} and v_cache {v_cache.dtype} "
                         "differ")
    if q_out is None:
        q_out = q
    elif q_out.shape != q.shape or q_out.dtype != q.dtype:
        raise ValueError(f"norm_rope_store: q_out {tuple(q_out.shape)} {q_out.dtype} does not "
                         f"match q {tuple(q.shape)} {q.dtype}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("norm_rope_store: give both q_weight and k_weight, or neither")
    if q_weight is not None and (q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,)):
        raise ValueError(f"norm_rope_store: q_weight {tuple(q_weight.shape)} and k_weight "
                         f"{tuple(k_weight.shape)} must be ({head_dim},)")
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"norm_rope_store: k_scale and v_scale must be > 0, got {k_scale}, "
                         f"{v_scale}")
    check_block_size(k_cache.shape[1])
    for name, x in (("q", q), ("q_out", q_out), ("k", k), ("v", v),
                    ("cos_sin_cache", cos_sin_cache),
                    ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"norm_rope_store: {name} must be contiguous in its last dim")
    if num_tokens == 0:
        return q_out
    consts = _fp8_constants(k_cache.dtype)
    # NOTE: as in store_kv: the interpreter's fp32 -> fp8 rounding is wrong, so on the CPU the
    # kernel writes the FP8 bits it builds itself through a uint8 view.
    soft = k_cache.dtype in FP8_DTYPES and not is_gpu(k_cache)
    if soft:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    half = head_dim // 2
    block_h = heads_per_program(head_dim, max(num_q_heads, num_kv_heads))
    q_groups = triton.cdiv(num_q_heads, block_h)
    has_norm = q_weight is not None
    pdl = pdl_args(q)
    _norm_rope_store_kernel[(num_tokens, q_groups + triton.cdiv(num_kv_heads, block_h))](
        q, q_out, k, v, positions, cos_sin_cache, q_weight if has_norm else q,
        k_weight if has_norm else q, k_cache, v_cache, slot_mapping, eps,
        1.0 / k_scale, 1.0 / v_scale,
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, Q_GROUPS=q_groups,
        HALF=half, BLOCK_H=block_h, BLOCK_R=next_pow2(half), BLOCK_SIZE=k_cache.shape[1],
        HAS_NORM=has_norm, SOFT_FP8=soft, num_warps=2 if block_h * head_dim <= 512 else 4,
        RELEASE=release_rope_store(pdl, num_tokens, gemv_projections),
        EARLY=early_step_inputs(pdl), **consts, **pdl,
    )
    return q_out
