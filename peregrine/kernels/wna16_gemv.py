"""Split-K GEMV for weight-only int weights in layers/quantization/wna16.py's layout, for decode
batches of at most GEMV_MAX_M rows: y (M, N) = x (M, K) @ dequant(W) (K, N).

Each program owns BLOCK_N output columns and a K range. Per K block it loads the (BLOCK_K / pack,
BLOCK_N) packed int32 words once (rows of N contiguous words: coalesced), and for each of the
pack values a word holds takes a shift and a mask in registers. An integer q < 2^23 becomes the
float 2^23 + q by OR-ing it into the mantissa of 2^23, so q - zero is one float subtraction of
(2^23 + zero). Each row m keeps a (words, BLOCK_N) float32 accumulator in the words' own layout:
acc_m += scale * sum_j (q_j - zero) * x[m, k_j], so nothing crosses threads until the end, where
one reduction over the words gives the row's sums. Split-K partials are combined as in gemv.py
(deterministic). Act-order (g_idx) weights use the GEMM (wna16_gemm.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from peregrine.kernels.gemv import (GEMV_MAX_M, GemvConfig, block_m_for, choose_split,
                                    finish_split_k, launch_buffers, store_partial)

if TYPE_CHECKING:
    from peregrine.layers.quantization.wna16 import WNA16Layout

_MAGIC = 0x4B000000  # the bits of 2^23 as float32


@triton.jit
def _x_col(a_ptr, m, M, stride_am, kk, k_mask):
    """x[m, kk] for the words' rows (WORDS,), float32, zero past row M."""
    row_ok = (kk * 0 + m) < M
    return tl.load(a_ptr + m * stride_am + kk, mask=k_mask & row_ok, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["M", "stride_am", "stride_cm", "K_ITERS", "SPLIT_K"])
def _wna16_gemv_kernel(
    a_ptr, q_ptr, qhi_ptr, s_ptr, z_ptr, part_ptr, lock_ptr, c_ptr,
    M, N, K, stride_am, stride_cm, K_ITERS, SPLIT_K,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZP: tl.constexpr, PER_WORD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SPLIT: tl.constexpr,
):
    PACK: tl.constexpr = 4 if BITS == 8 else 8  # values per word of the main plane
    WIDTH: tl.constexpr = 8 if BITS == 8 else 4  # bits per value in the main plane
    WORDS: tl.constexpr = BLOCK_K // PACK
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WORDS)  # (W,)
    acc0 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    acc4 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    acc5 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    acc6 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    acc7 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    half: tl.constexpr = 1 << (BITS - 1)
    for it in range(0, K_ITERS):
        k0 = (split * K_ITERS + it) * BLOCK_K
        word = k0 // PACK + offs_w  # (W,) word rows of the main plane
        w_mask = word < K // PACK
        tile_mask = w_mask[:, None] & n_mask[None, :]
        words = tl.load(q_ptr + word.to(tl.int64)[:, None] * N + offs_n[None, :], mask=tile_mask,
                        other=0)  # (W, BN) int32
        if BITS == 6:  # the high 2 bits: 16 per word, so word row w's values sit at half w // 2
            hi = tl.load(qhi_ptr + (word // 2).to(tl.int64)[:, None] * N + offs_n[None, :],
                         mask=tile_mask, other=0)  # (W, BN) int32
            hi_base = ((word % 2) * 16)[:, None]  # (W, 1)
        if PER_WORD:  # groups smaller than the block: each word row reads its group's row
            grp = (word * PACK) // GROUP  # (W,)
            s = tl.load(s_ptr + grp.to(tl.int64)[:, None] * N + offs_n[None, :], mask=tile_mask,
                        other=0.0).to(tl.float32)  # (W, BN)
            if HAS_ZP:
                z = tl.load(z_ptr + grp.to(tl.int64)[:, None] * N + offs_n[None, :],
                            mask=tile_mask, other=0.0).to(tl.float32) + 8388608.0
            else:
                z = tl.full((WORDS, BLOCK_N), 8388608.0 + half, tl.float32)
        else:  # the whole block is in one group
            grp = k0 // GROUP
            s = tl.load(s_ptr + grp * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if HAS_ZP:
                z = tl.load(z_ptr + grp * N + offs_n, mask=n_mask,
                            other=0.0).to(tl.float32)[None, :] + 8388608.0  # (1, BN)
            else:
                z = tl.full((1, BLOCK_N), 8388608.0 + half, tl.float32)
        t0 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        t1 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        t2 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        t3 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        t4 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        t5 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        t6 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        t7 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(PACK):
            q = (words >> (j * WIDTH)) & ((1 << WIDTH) - 1)  # (W, BN) int32
            if BITS == 6:
                q = q | (((hi >> (hi_base + 2 * j)) & 0x3) << 4)
            # NOTE: (2^23 + q) - (2^23 + zero) is exact: q - zero as one float subtraction.
            d = (q | 0x4B000000).to(tl.float32, bitcast=True) - z  # (W, BN)
            kk = word * PACK + j  # (W,) the inputs of value j
            t0 += d * _x_col(a_ptr, 0, M, stride_am, kk, w_mask)[:, None]
            if BLOCK_M > 1:
                t1 += d * _x_col(a_ptr, 1, M, stride_am, kk, w_mask)[:, None]
            if BLOCK_M > 2:
                t2 += d * _x_col(a_ptr, 2, M, stride_am, kk, w_mask)[:, None]
                t3 += d * _x_col(a_ptr, 3, M, stride_am, kk, w_mask)[:, None]
            if BLOCK_M > 4:
                t4 += d * _x_col(a_ptr, 4, M, stride_am, kk, w_mask)[:, None]
                t5 += d * _x_col(a_ptr, 5, M, stride_am, kk, w_mask)[:, None]
                t6 += d * _x_col(a_ptr, 6, M, stride_am, kk, w_mask)[:, None]
                t7 += d * _x_col(a_ptr, 7, M, stride_am, kk, w_mask)[:, None]
        acc0 += t0 * s
        if BLOCK_M > 1:
            acc1 += t1 * s
        if BLOCK_M > 2:
            acc2 += t2 * s
            acc3 += t3 * s
        if BLOCK_M > 4:
            acc4 += t4 * s
            acc5 += t5 * s
            acc6 += t6 * s
            acc7 += t7 * s
    store_partial(part_ptr, c_ptr, tl.sum(acc0, axis=0), 0, M, N, split, offs_n, n_mask,
                  stride_cm, HAS_SPLIT)
    if BLOCK_M > 1:
        store_partial(part_ptr, c_ptr, tl.sum(acc1, axis=0), 1, M, N, split, offs_n, n_mask,
                      stride_cm, HAS_SPLIT)
    if BLOCK_M > 2:
        store_partial(part_ptr, c_ptr, tl.sum(acc2, axis=0), 2, M, N, split, offs_n, n_mask,
                      stride_cm, HAS_SPLIT)
        store_partial(part_ptr, c_ptr, tl.sum(acc3, axis=0), 3, M, N, split, offs_n, n_mask,
                      stride_cm, HAS_SPLIT)
    if BLOCK_M > 4:
        store_partial(part_ptr, c_ptr, tl.sum(acc4, axis=0), 4, M, N, split, offs_n, n_mask,
                      stride_cm, HAS_SPLIT)
        store_partial(part_ptr, c_ptr, tl.sum(acc5, axis=0), 5, M, N, split, offs_n, n_mask,
                      stride_cm, HAS_SPLIT)
        store_partial(part_ptr, c_ptr, tl.sum(acc6, axis=0), 6, M, N, split, offs_n, n_mask,
                      stride_cm, HAS_SPLIT)
        store_partial(part_ptr, c_ptr, tl.sum(acc7, axis=0), 7, M, N, split, offs_n, n_mask,
                      stride_cm, HAS_SPLIT)
    finish_split_k(part_ptr, lock_ptr, c_ptr, M, N, pid_n, offs_n, n_mask, stride_cm,
                   SPLIT_K, HAS_SPLIT, BLOCK_M, BLOCK_N)


# 16 rows of 64 words per K block. Compiled for sm_90 (4-bit, zero points): 4 warps at 1 / 2 /
# 4 rows take 56 / 89 / 128 registers and about 6.6 / 8.9 / 12.3 instructions per weight value
# in the K loop; 8 rows take 8 warps (169 registers, 22.7 per value) where 4 would use all 255.
_WORDS = 16
_BLOCK_N = 64


def _block_k(bits: int) -> int:
    return _WORDS * (4 if bits == 8 else 8)


def gemv_supported(w: WNA16Layout, block_k: int | None = None) -> bool:
    """Whether the GEMV reads this layout: no act-order, and every K block either inside one
    group or made of whole words of each group."""
    if w.g_idx is not None:
        return False
    bk = block_k or _block_k(w.bits)
    pack = 4 if w.bits == 8 else 8
    g = w.group_size
    return g % bk == 0 or g == w.in_features or (bk % g == 0 and g % pack == 0)


def gemv_config(w: WNA16Layout, device: torch.device, block_m: int = 1) -> GemvConfig:
    """64 output columns (256 bytes of words per row) per program; K split to fill the SMs."""
    block_k = _block_k(w.bits)
    tiles = triton.cdiv(w.out_features, _BLOCK_N)
    split, k_iters = choose_split(tiles, triton.cdiv(w.in_features, block_k), device)
    return GemvConfig(_BLOCK_N, block_k, split, k_iters, 8 if block_m > 4 else 4)


def wna16_gemv(x: torch.Tensor, w: WNA16Layout, config: GemvConfig | None = None) -> torch.Tensor:
    """y (..., N) = x (..., K) @ dequant(w) (K, N) in x's dtype, for at most GEMV_MAX_M rows."""
    k, n = w.in_features, w.out_features
    if x.shape[-1] != k:
        raise ValueError(f"wna16_gemv: x has {x.shape[-1]} inputs, the weight {k}")
    lead = x.shape[:-1]
    a = x.reshape(-1, k)  # (M, K)
    if a.stride(-1) != 1:
        a = a.contiguous()
    m = a.shape[0]
    bm = block_m_for(m)
    cfg = config or gemv_config(w, x.device, bm)
    if cfg.block_k & (cfg.block_k - 1) or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"wna16_gemv: block_k {cfg.block_k} and block_n {cfg.block_n} must be "
                         "powers of two")
    if not gemv_supported(w, cfg.block_k):
        raise ValueError(f"wna16_gemv: group size {w.group_size} (act-order: "
                         f"{w.g_idx is not None}) does not fit K blocks of {cfg.block_k}")
    if cfg.block_k % (16 if w.bits == 6 else 32 // w.bits):
        raise ValueError(f"wna16_gemv: block_k {cfg.block_k} is not whole words of {w.bits} bits")
    per_word = not (w.group_size % cfg.block_k == 0 or w.group_size == k)
    tiles = triton.cdiv(n, cfg.block_n)
    out, part, lock = launch_buffers(a, n, tiles, cfg.split_k)
    q = w.qweight
    _wna16_gemv_kernel[(tiles, cfg.split_k)](
        a, q, w.qweight_hi if w.qweight_hi is not None else q, w.scales,
        w.zeros if w.zeros is not None else w.scales, part, lock, out,
        m, n, k, a.stride(0), out.stride(0), cfg.k_iters, cfg.split_k,
        GROUP=w.group_size, BITS=w.bits, HAS_ZP=w.zeros is not None, PER_WORD=per_word,
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_SPLIT=cfg.split_k > 1,
        num_warps=cfg.num_warps)
    return out.reshape(*lead, n)


def precompile_wna16_gemv(w: WNA16Layout, dtype: torch.dtype) -> None:
    """Compile this layer's GEMV for every row count it can serve (call at load time)."""
    if not (w.qweight.is_cuda and gemv_supported(w)):
        return
    for rows in sorted({block_m_for(m) for m in range(1, GEMV_MAX_M + 1)}):
        wna16_gemv(torch.zeros(rows, w.in_features, dtype=dtype, device=w.qweight.device), w)
