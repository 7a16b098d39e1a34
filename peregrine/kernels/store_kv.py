"""Scatter the new tokens' K/V into the paged cache (one program per token)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from peregrine.kernels._utils import check_block_size, next_pow2


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
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
    tl.store(kc + offs_h[:, None] * stride_kc_h + offs_d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vc_h + offs_d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k/v (T, Hkv, D) into k_cache/v_cache (num_blocks, block_size, Hkv, D) at slot_mapping
    (T,); slots < 0 are skipped."""
    num_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"slot_mapping {tuple(slot_mapping.shape)} do not match")
    if k_cache.shape[2:] != (num_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"store_kv: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not "
                         f"fit k {tuple(k.shape)}")
    check_block_size(k_cache.shape[1])
    # NOTE: the head dim is addressed with unit stride, so only the last dim must be contiguous.
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"store_kv: {name} must be contiguous in its last dim")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )
