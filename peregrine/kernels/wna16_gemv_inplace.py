"""The weight-only int GEMV's in-place variant (wna16_gemv.py launches it): 4 and 8-bit weights,
whole K blocks inside one group.

Each value is turned into a float where it sits in its word, without a shift: a word w splits
into its low and high 16-bit halves (one shift), and value p of a half (bits p * b ..) becomes
the float 2^23 + q * 2^(b p) by one AND-OR into the mantissa of 2^23 (exact: q * 2^(b p) < 2^23
for the two halves' positions). Subtracting the column's constant 2^23 + zero * 2^(b p) leaves
(q - zero) * 2^(b p) exactly, and x's input at that position is loaded pre-multiplied by
2^(-b p) (exact: a power of two), so one FMA adds (q - zero) * x. Per 4-bit value that is an
AND-OR, a subtraction and an FMA (the shift is shared by a word's 8 values), against a shift,
a mask, an OR, a subtraction and an FMA in the plain fma variant. Per K block each row's
(words, columns) sums are multiplied by the block's scales; split-K partials are combined as in
gemv.py (deterministic). With PREFETCH (the inplace_prefetch variant) each iteration issues
the next K block's loads before its own arithmetic.
"""
from __future__ import annotations

import triton
import triton.language as tl

from peregrine.kernels._utils import pdl_release, pdl_wait
from peregrine.kernels.gemv import row_accumulators, store_row_sums

_TWO_23 = tl.constexpr(8388608.0)  # 2^23: its float32 ulp is 1
# One word's 8 4-bit values in place: $8 the word, $9..$12 the columns' 2^23 + zero * 16^p;
# out j = (q_j - zero) * 16^(j % 4). 17 instructions per 8 values. (Written out because the
# compiler otherwise turns "shift the high half once, then mask in place" into a shift per value.)
ASM_U4 = tl.constexpr("""{
.reg .b32 h, t;
shr.u32 h, $8, 16;
lop3.b32 t, $8, 0x0000000F, 0x4B000000, 0xEA;
sub.f32 $0, t, $9;
lop3.b32 t, $8, 0x000000F0, 0x4B000000, 0xEA;
sub.f32 $1, t, $10;
lop3.b32 t, $8, 0x00000F00, 0x4B000000, 0xEA;
sub.f32 $2, t, $11;
lop3.b32 t, $8, 0x0000F000, 0x4B000000, 0xEA;
sub.f32 $3, t, $12;
lop3.b32 t, h, 0x0000000F, 0x4B000000, 0xEA;
sub.f32 $4, t, $9;
lop3.b32 t, h, 0x000000F0, 0x4B000000, 0xEA;
sub.f32 $5, t, $10;
lop3.b32 t, h, 0x00000F00, 0x4B000000, 0xEA;
sub.f32 $6, t, $11;
lop3.b32 t, h, 0x0000F000, 0x4B000000, 0xEA;
sub.f32 $7, t, $12;
}""")
# The same for 8-bit values: $4 the word, $5, $6 the columns' 2^23 + zero * 256^p.
ASM_U8 = tl.constexpr("""{
.reg .b32 h, t;
shr.u32 h, $4, 16;
lop3.b32 t, $4, 0x000000FF, 0x4B000000, 0xEA;
sub.f32 $0, t, $5;
lop3.b32 t, $4, 0x0000FF00, 0x4B000000, 0xEA;
sub.f32 $1, t, $6;
lop3.b32 t, h, 0x000000FF, 0x4B000000, 0xEA;
sub.f32 $2, t, $5;
lop3.b32 t, h, 0x0000FF00, 0x4B000000, 0xEA;
sub.f32 $3, t, $6;
}""")


@triton.jit
def _load_block(q_ptr, s_ptr, z_ptr, k0, K, N, offs_w, offs_n, n_mask, k_end, GROUP: tl.constexpr,
                BITS: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """The K block at k0's words (W, BN) int32, float32 scales and zero points (BN,) (the
    whole block is in one group: the launcher makes it so); nothing is read from k_end (this
    program's end) or K on (zero words, the last group's scales)."""
    PACK: tl.constexpr = 32 // BITS
    word = k0 // PACK + offs_w  # (W,)
    w_mask = (word < K // PACK) & (word < k_end // PACK)
    words = tl.load(q_ptr + word.to(tl.int64)[:, None] * N + offs_n[None, :],
                    mask=w_mask[:, None] & n_mask[None, :], other=0)
    grp = tl.minimum(k0, K - 1) // GROUP
    s_mask = n_mask & ((offs_n * 0 + k0) < k_end)
    s = tl.load(s_ptr + grp * N + offs_n, mask=s_mask, other=0.0).to(tl.float32)
    if HAS_ZP:
        z = tl.load(z_ptr + grp * N + offs_n, mask=s_mask, other=0.0).to(tl.float32)
    else:
        z = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)
    return words, s, z


@triton.jit
def _in_place(lo, hi, p: tl.constexpr, c, BITS: tl.constexpr):
    """(q - zero) * 2^(BITS p) of value p of a 16-bit half (lo: the word, hi: word >> 16)."""
    mask: tl.constexpr = ((1 << BITS) - 1) << (BITS * p)
    d_lo = ((lo & mask) | 0x4B000000).to(tl.float32, bitcast=True) - c
    d_hi = ((hi & mask) | 0x4B000000).to(tl.float32, bitcast=True) - c
    return d_lo, d_hi


@triton.jit
def _x_bf16(x64, SCALE_BITS: tl.constexpr):
    """The 4 bf16 values packed in each int64 of x64 (W,), as float32, each times 2^-(b p) for
    the position p its weight value has in its 16-bit half (b = SCALE_BITS)."""
    lo = x64.to(tl.int32)  # values 0, 1
    hi = (x64 >> 32).to(tl.int32)  # values 2, 3
    v0 = (lo << 16).to(tl.float32, bitcast=True)
    v1 = (lo & -65536).to(tl.float32, bitcast=True)
    v2 = (hi << 16).to(tl.float32, bitcast=True)
    v3 = (hi & -65536).to(tl.float32, bitcast=True)
    if SCALE_BITS == 4:  # 4-bit: x64 holds positions 0..3 of one half
        return v0, v1 * 0.0625, v2 * 0.00390625, v3 * 0.000244140625
    else:  # 8-bit: positions 0, 1 of the low half, then of the high half
        return v0, v1 * 0.00390625, v2, v3 * 0.00390625


@triton.jit
def _x_at(a_ptr, row, stride_am, kk, k_mask, SCALE: tl.constexpr, EVEN_K: tl.constexpr):
    """x[row, kk] * SCALE for the words' rows (WORDS,), float32 (zero past K)."""
    if EVEN_K:
        x = tl.load(a_ptr + row * stride_am + kk)
    else:
        x = tl.load(a_ptr + row * stride_am + kk, mask=k_mask, other=0.0)
    return x.to(tl.float32) * SCALE


@triton.jit
def load_x_pairs(base, w_mask, EVEN_K: tl.constexpr):
    """bf16 x as two 8-byte loads per word row at base (W,) and base + 1: inputs 0..3 and 4..7
    of the row's 8 (zero past K)."""
    if EVEN_K:
        xa = tl.load(base)
        xb = tl.load(base + 1)
    else:
        xa = tl.load(base, mask=w_mask, other=0)
        xb = tl.load(base + 1, mask=w_mask, other=0)
    return xa, xb


@triton.jit
def _row_sum(t, a_ptr, a64_ptr, m, M, stride_am, word, w_mask, d0, d1, d2, d3, d4, d5, d6, d7,
             BITS: tl.constexpr, X_BF16: tl.constexpr, EVEN_K: tl.constexpr):
    """t (W, BN) + sum_j d_j * x[m, word * PACK + j] * 2^-(BITS (j % HALF))."""
    row = tl.minimum(m, M - 1)  # rows past M read row M - 1; their sums are never stored
    if BITS == 4:
        if X_BF16:  # two int64 loads per word row: inputs 0..3 and 4..7
            xa, xb = load_x_pairs(a64_ptr + row * (stride_am // 4) + word * 2, w_mask, EVEN_K)
            x0, x1, x2, x3 = _x_bf16(xa, 4)
            x4, x5, x6, x7 = _x_bf16(xb, 4)
        else:
            kk = word * 8
            x0 = _x_at(a_ptr, row, stride_am, kk, w_mask, 1.0, EVEN_K)
            x1 = _x_at(a_ptr, row, stride_am, kk + 1, w_mask, 0.0625, EVEN_K)
            x2 = _x_at(a_ptr, row, stride_am, kk + 2, w_mask, 0.00390625, EVEN_K)
            x3 = _x_at(a_ptr, row, stride_am, kk + 3, w_mask, 0.000244140625, EVEN_K)
            x4 = _x_at(a_ptr, row, stride_am, kk + 4, w_mask, 1.0, EVEN_K)
            x5 = _x_at(a_ptr, row, stride_am, kk + 5, w_mask, 0.0625, EVEN_K)
            x6 = _x_at(a_ptr, row, stride_am, kk + 6, w_mask, 0.00390625, EVEN_K)
            x7 = _x_at(a_ptr, row, stride_am, kk + 7, w_mask, 0.000244140625, EVEN_K)
        t += d0 * x0[:, None]
        t += d1 * x1[:, None]
        t += d2 * x2[:, None]
        t += d3 * x3[:, None]
        t += d4 * x4[:, None]
        t += d5 * x5[:, None]
        t += d6 * x6[:, None]
        t += d7 * x7[:, None]
    else:
        if X_BF16:  # one int64 load per word row: inputs 0..3
            base = a64_ptr + row * (stride_am // 4) + word
            if EVEN_K:
                xa = tl.load(base)
            else:
                xa = tl.load(base, mask=w_mask, other=0)
            x0, x1, x2, x3 = _x_bf16(xa, 8)
        else:
            kk = word * 4
            x0 = _x_at(a_ptr, row, stride_am, kk, w_mask, 1.0, EVEN_K)
            x1 = _x_at(a_ptr, row, stride_am, kk + 1, w_mask, 0.00390625, EVEN_K)
            x2 = _x_at(a_ptr, row, stride_am, kk + 2, w_mask, 1.0, EVEN_K)
            x3 = _x_at(a_ptr, row, stride_am, kk + 3, w_mask, 0.00390625, EVEN_K)
        t += d0 * x0[:, None]
        t += d1 * x1[:, None]
        t += d2 * x2[:, None]
        t += d3 * x3[:, None]
    return t


@triton.jit(do_not_specialize=["M", "stride_am", "stride_cm", "K_ITERS", "SPLIT_K"])
def _wna16_gemv_inplace_kernel(
    a_ptr, a64_ptr, q_ptr, s_ptr, z_ptr, part_ptr, lock_ptr, c_ptr,
    M, N, K, stride_am, stride_cm, K_ITERS, SPLIT_K,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZP: tl.constexpr, ASM: tl.constexpr,
    X_BF16: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SPLIT: tl.constexpr,
    PDL: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS  # values per word
    WORDS: tl.constexpr = BLOCK_K // PACK
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WORDS)  # (W,)
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = row_accumulators(WORDS, BLOCK_N)
    # NOTE: with PREFETCH each iteration issues the next K block's loads before its own math,
    # so they are in flight while it computes (registers, not shared memory).
    k_end = (split + 1) * K_ITERS * BLOCK_K  # this program's K range ends here
    if PREFETCH:
        nxt_words, nxt_s, nxt_z = _load_block(q_ptr, s_ptr, z_ptr, split * K_ITERS * BLOCK_K, K,
                                              N, offs_w, offs_n, n_mask, k_end, GROUP, BITS,
                                              HAS_ZP, BLOCK_N, BLOCK_K)
    # NOTE: the first K block's words, scales and zeros (constant) load while the kernel
    # before this one finishes; x and everything else only after the wait.
    pdl_wait(PDL)
    for it in range(0, K_ITERS):
        k0 = (split * K_ITERS + it) * BLOCK_K
        word = k0 // PACK + offs_w  # (W,)
        w_mask = word < K // PACK
        if PREFETCH:
            words, s, z = nxt_words, nxt_s, nxt_z
            nxt_words, nxt_s, nxt_z = _load_block(q_ptr, s_ptr, z_ptr, k0 + BLOCK_K, K, N,
                                                  offs_w, offs_n, n_mask, k_end, GROUP, BITS,
                                                  HAS_ZP, BLOCK_N, BLOCK_K)
        else:
            words, s, z = _load_block(q_ptr, s_ptr, z_ptr, k0, K, N, offs_w, offs_n, n_mask,
                                      K, GROUP, BITS, HAS_ZP, BLOCK_N, BLOCK_K)
        s = s[None, :]
        # NOTE: 2^23 + zero * 2^(BITS p) is exact (an integer below 2^24), so subtracting it
        # from 2^23 + q * 2^(BITS p) leaves (q - zero) * 2^(BITS p) exactly.
        c0 = (z + _TWO_23)[None, :]  # (1, BN)
        c1 = (z * (1 << BITS) + _TWO_23)[None, :]
        c2 = (z * (1 << (2 * BITS)) + _TWO_23)[None, :]
        c3 = (z * (1 << (3 * BITS)) + _TWO_23)[None, :]
        if BITS == 4:
            if ASM:
                d0, d1, d2, d3, d4, d5, d6, d7 = tl.inline_asm_elementwise(
                    ASM_U4, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r", [words, c0, c1, c2, c3],
                    dtype=(tl.float32,) * 8, is_pure=True, pack=1)
            else:
                lo = words.to(tl.uint32, bitcast=True)
                hi = lo >> 16
                d0, d4 = _in_place(lo, hi, 0, c0, BITS)
                d1, d5 = _in_place(lo, hi, 1, c1, BITS)
                d2, d6 = _in_place(lo, hi, 2, c2, BITS)
                d3, d7 = _in_place(lo, hi, 3, c3, BITS)
        else:
            if ASM:
                d0, d1, d2, d3 = tl.inline_asm_elementwise(
                    ASM_U8, "=r,=r,=r,=r,r,r,r", [words, c0, c1], dtype=(tl.float32,) * 4,
                    is_pure=True, pack=1)
            else:
                lo = words.to(tl.uint32, bitcast=True)
                hi = lo >> 16
                d0, d2 = _in_place(lo, hi, 0, c0, BITS)
                d1, d3 = _in_place(lo, hi, 1, c1, BITS)
            d4 = d0  # unused at 8 bits
            d5 = d0
            d6 = d0
            d7 = d0
        t = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        acc0 += _row_sum(t, a_ptr, a64_ptr, 0, M, stride_am, word, w_mask, d0, d1, d2, d3, d4,
                         d5, d6, d7, BITS, X_BF16, EVEN_K) * s
        if BLOCK_M > 1:
            acc1 += _row_sum(t, a_ptr, a64_ptr, 1, M, stride_am, word, w_mask, d0, d1, d2, d3,
                             d4, d5, d6, d7, BITS, X_BF16, EVEN_K) * s
        if BLOCK_M > 2:
            acc2 += _row_sum(t, a_ptr, a64_ptr, 2, M, stride_am, word, w_mask, d0, d1, d2, d3,
                             d4, d5, d6, d7, BITS, X_BF16, EVEN_K) * s
            acc3 += _row_sum(t, a_ptr, a64_ptr, 3, M, stride_am, word, w_mask, d0, d1, d2, d3,
                             d4, d5, d6, d7, BITS, X_BF16, EVEN_K) * s
        if BLOCK_M > 4:
            acc4 += _row_sum(t, a_ptr, a64_ptr, 4, M, stride_am, word, w_mask, d0, d1, d2, d3,
                             d4, d5, d6, d7, BITS, X_BF16, EVEN_K) * s
            acc5 += _row_sum(t, a_ptr, a64_ptr, 5, M, stride_am, word, w_mask, d0, d1, d2, d3,
                             d4, d5, d6, d7, BITS, X_BF16, EVEN_K) * s
            acc6 += _row_sum(t, a_ptr, a64_ptr, 6, M, stride_am, word, w_mask, d0, d1, d2, d3,
                             d4, d5, d6, d7, BITS, X_BF16, EVEN_K) * s
            acc7 += _row_sum(t, a_ptr, a64_ptr, 7, M, stride_am, word, w_mask, d0, d1, d2, d3,
                             d4, d5, d6, d7, BITS, X_BF16, EVEN_K) * s
    pdl_release(PDL)
    store_row_sums(part_ptr, lock_ptr, c_ptr, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, M,
                   N, pid_n, split, offs_n, n_mask, stride_cm, SPLIT_K, HAS_SPLIT, BLOCK_M,
                   BLOCK_N)
