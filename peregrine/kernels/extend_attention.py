"""Prefill/extend attention over a paged cache for a packed batch of variable-length chunks.

Sequence i's new tokens are q[qsl[i]:qsl[i+1]] at positions seq_len_i - q_len_i .. seq_len_i - 1;
their keys/values (cached prefix and the new tokens, already stored) are read through the block
table. Online softmax (FlashAttention-style) keeps memory O(N). Grid: (query blocks, q heads, seqs).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from peregrine.kernels._utils import (check_block_size, check_q_and_caches, check_window_and_out,
                                      dot_precision, is_gpu, kv_dot_dtype, may_reuse_launches,
                                      next_pow2)

_LOG2E = math.log2(math.e)
_reuse_launches = True  # False once a compiled launch refused its arguments (see extend_attention)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, n0, q_pos, kv_end, k_base, v_base, bt_row,
                 stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s, scale_log2,
                 offs_d, d_mask, window, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, HAS_WINDOW: tl.constexpr):
    tok = n0 + tl.arange(0, BLOCK_N)  # (BN,) key positions
    off = tok % BLOCK_SIZE  # (BN,)
    if MASKED:  # the diagonal / last tiles: past the context or the query is invisible
        n_mask = tok < kv_end  # (BN,)
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)  # (BN,)
        kt_mask = d_mask[:, None] & n_mask[None, :]  # (BD, BN)
        v_mask = n_mask[:, None] & d_mask[None, :]  # (BN, BD)
    else:  # NOTE: unmasked tiles lie wholly inside the context: only the head dim is masked
        blk = tl.load(bt_row + tok // BLOCK_SIZE).to(tl.int64)  # (BN,)
        kt_mask = d_mask[:, None]
        v_mask = d_mask[None, :]
    k_t = tl.load(k_base + blk[None, :] * stride_kc_b + off[None, :] * stride_kc_s
                  + offs_d[:, None], mask=kt_mask, other=0.0).to(DOT_DTYPE)  # (BD, BN)
    # NOTE: the K scale is inside scale_log2 and the V scale is applied once at the end, so an
    # FP8 tile costs one conversion per element here and nothing more.
    s = tl.dot(q, k_t, input_precision=DOT_PREC) * scale_log2  # (BM, BN)
    if MASKED:
        visible = (tok[None, :] <= q_pos[:, None]) & (tok[None, :] < kv_end)  # (BM, BN)
        if HAS_WINDOW:  # a query at position p sees keys p - window + 1 .. p
            visible = visible & (tok[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # (BM,)
    if HAS_WINDOW:
        # NOTE: a row may see no key of this tile and none before it: keep it NaN-free.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)  # (BM,)
    p = tl.exp2(s - m_use[:, None])  # (BM, BN)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + blk[:, None] * stride_vc_b + off[:, None] * stride_vc_s
                + offs_d[None, :], mask=v_mask, other=0.0).to(DOT_DTYPE)  # (BN, BD)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


# NOTE: the decode count (seq_offset) varies step to step; no variant per value.
@triton.jit(do_not_specialize=["seq_offset", "window"])
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr, o_ptr,
    scale_log2, v_scale, seq_offset, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, HAS_WINDOW: tl.constexpr,
    CLAMP_Q: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.program_id(2) + seq_offset
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:  # grid is sized for the longest chunk
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    kvh = h // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)  # (BM,) row within the chunk
    offs_d = tl.arange(0, BLOCK_D)  # (BD,)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)  # (BM,) token index in the flat batch
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # (BM, BD)
    if CLAMP_Q:  # a bf16 query cast to fp16 for an FP8 cache (kv_dot_dtype)
        q = tl.minimum(tl.maximum(q, -65504.0), 65504.0)
    q = q.to(DOT_DTYPE)
    # NOTE: padding rows (offs_m >= q_len) sit at positions >= seq_len, so they still see key 0
    # and never produce NaN; they are simply not stored.
    q_pos = prefix + offs_m  # (BM,)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # (BM,)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # (BM,)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # (BM, BD)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kvh * stride_kc_h
    v_base = v_cache_ptr + kvh * stride_vc_h
    kv_end = tl.minimum(seq_len, prefix + m0 + BLOCK_M)
    if HAS_WINDOW:
        # NOTE: every tile is masked; they start at the oldest key the block's first row sees.
        first = tl.maximum(prefix + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
        full_end = first
    else:
        # Keys before the block's first query position are visible to every row: no mask.
        first = 0
        full_end = (prefix + m0) // BLOCK_N * BLOCK_N
    for n0 in range(first, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, n0, q_pos, kv_end, k_base, v_base, bt_row,
                                     stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
                                     scale_log2, offs_d, d_mask, window, HEAD_DIM, BLOCK_N,
                                     BLOCK_SIZE, False, DOT_DTYPE, DOT_PREC, HAS_WINDOW)
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, n0, q_pos, kv_end, k_base, v_base, bt_row,
                                     stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
                                     scale_log2, offs_d, d_mask, window, HEAD_DIM, BLOCK_N,
                                     BLOCK_SIZE, True, DOT_DTYPE, DOT_PREC, HAS_WINDOW)

    out = acc / l_i[:, None] * v_scale  # (BM, BD); the cache holds v / v_scale
    tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _default_blocks(head_dim: int, dtype: torch.dtype, on_gpu: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for this head_dim and dtype."""
    if not on_gpu:
        return 16, 16, 4
    if dtype == torch.float32:  # NOTE: 3-pass tf32 dots need 3x the registers; big tiles spill
        return 32, 32, 8
    # NOTE: measured on an H200 (docs/BENCHMARKS.md, tile sweep): 64x64 with 4 warps gives
    # 318 TFLOP/s at D=128 against 241 for 128x64x8, and 277 against 198 for 128x64x4 at D=64.
    return 64, 64, 4


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                     out: torch.Tensor | None = None, *, seq_start: int = 0,
                     num_seqs: int | None = None, block_m: int | None = None,
                     block_n: int | None = None, num_warps: int | None = None,
                     window: int | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0, launches: dict | None = None) -> torch.Tensor:
    """Causal attention of the packed chunks of sequences [seq_start, seq_start + num_seqs), q
    (T, Hq, D), over their paged contexts (with a sliding window, a query at position p sees
    keys p - window + 1 .. p); writes only those sequences' rows of out (T, Hq, D). The caches
    hold k / k_scale and v / v_scale (any float type, FP8 included).

    launches: a dict that lives as long as one step's metadata (so q, out, the block table, the
    sequence lengths and offsets are the same tensors on every call that finds it). The first
    call of a step keeps its compiled launch there; the next layers' calls, which differ only in
    their caches and scales, reuse it without the checks and Triton's argument binding: the
    host time of a layer's launch in a mixed step."""
    global _reuse_launches
    if launches is not None and out is not None and _reuse_launches:
        key = (q.data_ptr(), q.shape, q.dtype, out.data_ptr(), k_cache.shape, k_cache.dtype,
               k_cache.stride(), v_cache.stride(), k_cache.data_ptr() % 16 == 0,
               v_cache.data_ptr() % 16 == 0, seq_start, num_seqs, max_query_len, scale, window,
               block_m, block_n, num_warps)
        hit = launches.get(key)
        if hit is not None:
            launch, args = hit
            args[1], args[2] = k_cache, v_cache
            args[7], args[8] = scale * k_scale * _LOG2E, v_scale
            try:
                launch(*args)
                return out
            except TypeError:
                # NOTE: a Triton whose compiled launcher takes other arguments refuses them
                # before launching anything: launch through the JIT from now on.
                _reuse_launches = False
                launches.clear()
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = check_q_and_caches(q, k_cache, v_cache)
    total_seqs = seq_lens.shape[0]
    if num_seqs is None:
        num_seqs = total_seqs - seq_start
    if seq_start < 0 or num_seqs < 0 or seq_start + num_seqs > total_seqs:
        raise ValueError(f"sequences [{seq_start}, {seq_start + num_seqs}) out of {total_seqs}")
    if query_start_loc.shape != (total_seqs + 1,) or block_table.shape[0] != total_seqs:
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} / block_table "
                         f"{tuple(block_table.shape)} do not match {total_seqs} sequences")
    check_block_size(block_size)
    given_out = out
    out = check_window_and_out("extend_attention", q, out, k_cache, v_cache, window)  # (T, Hq, D)
    if num_seqs == 0 or max_query_len <= 0 or num_tokens == 0:
        return out
    on_gpu = is_gpu(q)
    dflt_m, dflt_n, dflt_warps = _default_blocks(head_dim, q.dtype, on_gpu)
    bm, bn, warps = block_m or dflt_m, block_n or dflt_n, num_warps or dflt_warps
    grid = (triton.cdiv(max_query_len, bm), num_q_heads, num_seqs)
    dot_type, clamp_q = kv_dot_dtype(q, k_cache)
    # NOTE: every parameter in the kernel's order (the cached launch below takes them so).
    args = [q, k_cache, v_cache, block_table, seq_lens, query_start_loc, out,
            scale * k_scale * _LOG2E, v_scale, seq_start, window or 0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_table.stride(0),
            num_q_heads // num_kv_heads, head_dim, max(16, next_pow2(head_dim)), bm, bn,
            block_size, dot_type, dot_precision(q), window is not None, clamp_q]
    compiled = _extend_kernel[grid](*args, num_warps=warps, num_stages=2)
    if (launches is not None and given_out is not None and compiled is not None
            and _reuse_launches and may_reuse_launches(q)):
        launches[key] = (compiled[grid], args)
    return out
