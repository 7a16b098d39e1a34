"""Neox-style rotary embedding (rotate halves; the HF Llama/Qwen convention), in place on q and k."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from peregrine.kernels._utils import next_pow2


@triton.jit
def _rotate_heads(x_ptr, row, stride_t, stride_h, cos, sin, num_heads,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)  # (BH,)
    offs_r = tl.arange(0, BLOCK_HALF)  # (BR,)
    mask = (offs_h[:, None] < num_heads) & (offs_r[None, :] < HALF)  # (BH, BR)
    ptr1 = x_ptr + row * stride_t + offs_h[:, None] * stride_h + offs_r[None, :]  # first half
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)  # (BH, BR)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)  # (BH, BR)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(ptr1, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr1 + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_HALF)  # (BR,)
    r_mask = offs_r < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_r, mask=r_mask,
                  other=0.0).to(tl.float32)  # (BR,)
    _rotate_heads(q_ptr, row, stride_qt, stride_qh, cos, sin, num_q_heads,
                  HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, row, stride_kt, stride_kh, cos, sin, num_kv_heads,
                  HALF, BLOCK_HK, BLOCK_HALF)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, Hq, D) and k (T, Hkv, D) in place and return them; cos_sin_cache (max_pos,
    rotary_dim) holds cos in its first half, sin in its second; dims past rotary_dim are kept."""
    num_tokens, num_q_heads, head_dim = q.shape
    rotary_dim = cos_sin_cache.shape[-1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape != (num_tokens,):
        raise ValueError(f"apply_rope: q {tuple(q.shape)}, k {tuple(k.shape)}, positions "
                         f"{tuple(positions.shape)} do not match")
    if rotary_dim % 2 or rotary_dim > head_dim or cos_sin_cache.dim() != 2:
        raise ValueError(f"apply_rope: cos_sin_cache {tuple(cos_sin_cache.shape)} does not fit "
                         f"head_dim {head_dim}")
    for name, x in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"apply_rope: {name} must be contiguous in its last dim")
    if num_tokens == 0:
        return q, k
    half = rotary_dim // 2
    _rope_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_q_heads, k.shape[1],
        HALF=half, BLOCK_HQ=next_pow2(num_q_heads), BLOCK_HK=next_pow2(k.shape[1]),
        BLOCK_HALF=next_pow2(half), num_warps=4,
    )
    return q, k
