"""Paged decode attention, split along the KV length (flash-decoding), CUDA-graph safe.

Stage 1 gives each (sequence, kv head, split) program one slice of the context; it processes all
q heads of that kv head's group together, so every K/V tile is loaded once. It writes a normalised
partial output and its log-sum-exp. Stage 2 merges the splits of each (sequence, q head).
The grid and every launch argument depend only on tensor shapes, never on seq_lens values.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from peregrine.kernels._utils import (check_block_size, check_q_and_caches, check_window_and_out,
                                      dot_precision, is_gpu, kv_dot_dtype, next_pow2, num_sms)

_MIN_SPLIT_LEN = 256  # tokens; shorter splits cost more in the merge than they win in parallelism
_MAX_SPLITS = 64
_PROGRAMS_PER_SM = 4


# NOTE: ints that change with the batch are not specialised on (==1, %16): each new value would
# compile a variant on the request path. The merge's BLOCK_S variants are compiled by precompile().
@triton.jit(do_not_specialize=["split_len", "window", "stride_bt", "stride_mo_b", "stride_mo_h",
                               "stride_ml_b", "stride_ml_h"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    scale_log2, split_len, window,
    stride_qb, stride_qh,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    stride_bt,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, HAS_WINDOW: tl.constexpr,
    CLAMP_Q: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * split_len
    if start >= seq_len:  # NOTE: splits past the context exit; the merge derives how many ran
        return
    end = tl.minimum(start + split_len, seq_len)
    if HAS_WINDOW:  # the query at seq_len - 1 sees keys seq_len - window .. seq_len - 1
        start = tl.maximum(start, seq_len - window)

    offs_g = tl.arange(0, BLOCK_G)  # (BG,)
    offs_d = tl.arange(0, BLOCK_D)  # (BD,)
    offs_n = tl.arange(0, BLOCK_N)  # (BN,)
    heads = kvh * GROUP + offs_g  # (BG,)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # (BG, BD)
    if CLAMP_Q:  # a bf16 query cast to fp16 for an FP8 cache (kv_dot_dtype)
        q = tl.minimum(tl.maximum(q, -65504.0), 65504.0)
    q = q.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # (BG,) running max, log2 units
    l_i = tl.zeros([BLOCK_G], tl.float32)  # (BG,) running sum
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)  # (BG, BD)
    bt_row = block_table_ptr + b64 * stride_bt
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n  # (BN,)
        n_mask = tok < end
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)  # (BN,)
        off = tok % BLOCK_SIZE  # (BN,)
        kv_mask = d_mask[:, None] & n_mask[None, :]  # (BD, BN)
        k_t = tl.load(k_cache_ptr + blk[None, :] * stride_kc_b + off[None, :] * stride_kc_s
                      + kvh * stride_kc_h + offs_d[:, None],
                      mask=kv_mask, other=0.0).to(DOT_DTYPE)  # (BD, BN)
        # NOTE: the K scale is inside scale_log2 and the V scale is applied by the merge, so an
        # FP8 tile costs one conversion per element here and nothing more.
        s = tl.dot(q, k_t, input_precision=DOT_PREC) * scale_log2  # (BG, BN)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # (BG,)
        alpha = tl.exp2(m_i - m_new)  # (BG,)
        p = tl.exp2(s - m_new[:, None])  # (BG, BN)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + blk[:, None] * stride_vc_b + off[:, None] * stride_vc_s
                    + kvh * stride_vc_h + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)  # (BN, BD)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PREC)
        m_i = m_new

    if HAS_WINDOW:
        # NOTE: a split wholly before the window saw no key: zero output and weight in the merge.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (BG, BD)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))  # (BG,)
    else:
        out = acc / l_i[:, None]  # (BG, BD)
        lse = m_i + tl.log2(l_i)  # (BG,)
    mo = mid_o_ptr + b64 * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s
    tl.store(mo + offs_d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(mid_lse_ptr + b64 * stride_ml_b + heads * stride_ml_h + split, lse, mask=g_mask)


@triton.jit(do_not_specialize=["split_len", "stride_mo_b", "stride_mo_h", "stride_ml_b",
                               "stride_ml_h"])
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, seq_lens_ptr, o_ptr, split_len, v_scale,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    b64 = b.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)
    num_splits = (seq_len + split_len - 1) // split_len  # splits that ran (0 for an empty seq)
    offs_s = tl.arange(0, BLOCK_S)  # (BS,)
    offs_d = tl.arange(0, BLOCK_D)  # (BD,)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + b64 * stride_ml_b + h * stride_ml_h + offs_s,
                  mask=s_mask, other=float("-inf"))  # (BS,)
    m = tl.max(lse, 0)
    m = tl.where(num_splits > 0, m, 0.0)  # NOTE: keeps an empty (padding) sequence free of NaN
    w = tl.exp2(lse - m)  # (BS,), 0 for splits that did not run
    o = tl.load(mid_o_ptr + b64 * stride_mo_b + h * stride_mo_h + offs_s[:, None] * stride_mo_s
                + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # (BS, BD)
    denom = tl.sum(w, 0)
    acc = tl.sum(w[:, None] * o, 0)  # (BD,)
    out = acc / tl.where(denom > 0, denom, 1.0) * v_scale  # the cache holds v / v_scale
    tl.store(o_ptr + b64 * stride_ob + h * stride_oh + offs_d,
             out.to(o_ptr.dtype.element_ty), mask=d_mask)


def decode_split_len(batch: int, num_kv_heads: int, max_blocks: int, block_size: int,
                     device: torch.device, block_n: int) -> int:
    """Tokens per split, from shapes only: enough programs to fill the GPU, at most _MAX_SPLITS."""
    max_ctx = max_blocks * block_size
    max_splits = max_decode_splits(max_ctx)
    want = math.ceil(_PROGRAMS_PER_SM * num_sms(device) / max(1, batch * num_kv_heads))
    splits = max(1, min(want, max_splits))
    return math.ceil(math.ceil(max_ctx / splits) / block_n) * block_n


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, *, split_len: int | None = None,
                           block_n: int | None = None, window: int | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0, num_warps: int | None = None,
                           num_stages: int = 2) -> torch.Tensor:
    """Attention of one query token per sequence, q (B, Hq, D), over its whole paged context of
    seq_lens[b] <= block_table.shape[1] * block_size tokens (only the last `window` tokens with a
    sliding window); returns out (B, Hq, D). A sequence with seq_len 0 (CUDA-graph padding)
    gets zeros. The caches hold k / k_scale and v / v_scale (any float type, FP8 included)."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = check_q_and_caches(q, k_cache, v_cache)
    if block_table.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"block_table {tuple(block_table.shape)} / seq_lens "
                         f"{tuple(seq_lens.shape)} do not match batch {batch}")
    check_block_size(block_size)
    out = check_window_and_out("paged_decode_attention", q, out, k_cache, v_cache, window)  # (B, Hq, D)
    if batch == 0:
        return out
    on_gpu = is_gpu(q)
    # NOTE: fp32 inputs run 3-pass tf32 dots on a GPU; a narrower tile keeps them from spilling.
    block_n = block_n or (16 if not on_gpu else 32 if q.dtype == torch.float32 else 64)
    if split_len is None:
        split_len = decode_split_len(batch, num_kv_heads, block_table.shape[1], block_size,
                                     q.device, block_n)
    if split_len % block_n:
        raise ValueError(f"split_len {split_len} must be a multiple of block_n {block_n}")
    num_splits = max(1, math.ceil(block_table.shape[1] * block_size / split_len))
    group = num_q_heads // num_kv_heads
    mid_o = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32,
                        device=q.device)  # (B, Hq, S, D)
    mid_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32,
                          device=q.device)  # (B, Hq, S)
    block_d = max(16, next_pow2(head_dim))
    dot_type, clamp_q = kv_dot_dtype(q, k_cache)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, mid_o, mid_lse,
        scale * k_scale * math.log2(math.e), split_len, window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d,
        BLOCK_N=block_n, BLOCK_SIZE=block_size,
        DOT_DTYPE=dot_type, DOT_PREC=dot_precision(q), HAS_WINDOW=window is not None,
        CLAMP_Q=clamp_q,
        num_warps=num_warps or (8 if q.dtype == torch.float32 and on_gpu else 4),
        num_stages=num_stages,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        mid_o, mid_lse, seq_lens, out, split_len, v_scale,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_pow2(num_splits),
        num_warps=4,
    )
    return out


def max_decode_splits(max_context: int) -> int:
    """The most splits decode_split_len gives a block table of max_context tokens (or fewer)."""
    return max(1, min(_MAX_SPLITS, math.ceil(max_context / _MIN_SPLIT_LEN)))


def precompile(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype, device: torch.device,
               cache_dtype: torch.dtype | None = None, max_context: int | None = None) -> None:
    """Compile every merge variant (one per power-of-two split count) now, so that no batch
    size met later compiles one on the request path. dtype: q's; cache_dtype: the KV cache's
    (default: dtype); max_context: the widest block table in tokens (default: any), which bounds
    the split counts a decode can use (a 512-token model needs 2 of the 7 variants)."""
    # NOTE: decode_split_len never gives a table of max_context tokens more than
    # max_decode_splits(max_context) splits, so the merge's BLOCK_S stays below its next power
    # of two; a caller passing split_len itself may go further and compile on first use.
    limit = _MAX_SPLITS if max_context is None else next_pow2(max_decode_splits(max_context))
    q = torch.zeros(1, num_q_heads, head_dim, dtype=dtype, device=device)
    cache = torch.zeros(1, block_size, num_kv_heads, head_dim, dtype=cache_dtype or dtype,
                        device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    block_n = 16 if not is_gpu(q) else 32 if dtype == torch.float32 else 64
    splits = 1
    while splits <= limit:  # splits of block_n tokens over a table of splits * block_n
        table = torch.zeros(1, -(-splits * block_n // block_size), dtype=torch.int32,
                            device=device)
        paged_decode_attention(q, cache, cache, table, seq_lens, 1.0, split_len=block_n,
                               block_n=block_n)
        splits *= 2
