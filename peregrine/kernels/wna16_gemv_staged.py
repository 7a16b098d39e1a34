"""The weight-only int GEMV's staged packed-half variant (wna16_gemv.py launches it as
`half2_staged`): 4-bit weights, one row of x, whole K blocks inside one group.

It computes what the packed-half variant (wna16_gemv_half2.py) computes, with two costs of that
kernel's K loop moved out of it:
- x is converted once per program, not once per K block and thread: before its K loop a program
  writes its K range's inputs as the loop reads them (four fp16 pairs per word row, scaled by
  2^-8, and each K block's input sum) into a small scratch buffer, then a barrier; the loop loads
  four pairs per word row instead of building them (in the packed-half kernel every thread builds
  the pairs of each of its word rows, 20-odd instructions per row and block).
- The zero point leaves the K loop: sum_j (q_j - z) x_j = sum_j q_j x_j - z sum_j x_j, so a word
  is dequantized against constants (q by one AND-OR and one packed subtraction or FMA of a
  constant) and z enters once per column and block, times the block's input sum, in float32.
  The loop needs no per-column constants; the packed-half kernel builds two per column and block
  and moves them, with the scales, between thread layouts through shared memory (six barriers a
  block). Here the scales are read in the words' own layout.
Every program of a K split writes the same scratch values (a program reads only what it wrote
itself, after the barrier). The result differs from the packed-half variant's by rounding only:
the word's four products (q_j x_j instead of (q_j - z) x_j, about twice as large) are summed in
fp16.

Offline (sm_90) its K loop is 25 instructions per word against the packed-half variant's 31,
with no barrier and 96 registers against 127. On an H200 that did not make it faster where it
matters: at Llama-3-8B's gate/up projection on 512-column tiles it took 24.1 us against 27.5,
but batch-1 decode with it there was no faster end to end, and at the smaller projections
(whose programs have few K blocks to spread the staging over) it was slower. A variant for
benchmarks, not a default.
"""
from __future__ import annotations

import triton
import triton.language as tl

from peregrine.kernels._utils import pdl_release, pdl_wait
from peregrine.kernels.gemv import finish_split_k, store_partial
from peregrine.kernels.wna16_gemv_half2 import (ASM_LANE_SUM, _gated_word_inputs, _pair,
                                               _x_word_inputs)

_UNDO = tl.constexpr(256.0)  # x was scaled by 2^-8
# One word's 8 4-bit values against x's four fp16 pairs: $1 the word, $2..$5 the pairs
# (x0, x4), (x1, x5), (x2, x6), (x3, x7). $0 = sum_j q_j x_j (x scaled). Lanes of w & 0x000F000F
# are 1024 + q (fp16 1024's ulp is 1), of w & 0x00F000F0 1024 + 16 q: minus 1024, or times 1/16
# minus 64, leaves q exactly.
ASM_DOT_U4_NZ = tl.constexpr("""{
.reg .b32 h, t, a, m, s, c;
.reg .b16 l, u;
.reg .f32 fl, fu;
mov.b32 m, 0x64006400;
mov.b32 s, 0x2C002C00;
mov.b32 c, 0xD400D400;
shr.u32 h, $1, 8;
lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t, t, m;
mul.f16x2 a, t, $2;
lop3.b32 t, $1, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 t, t, s, c;
fma.rn.f16x2 a, t, $3, a;
lop3.b32 t, h, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t, t, m;
fma.rn.f16x2 a, t, $4, a;
lop3.b32 t, h, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 t, t, s, c;
fma.rn.f16x2 a, t, $5, a;
""" + ASM_LANE_SUM)


@triton.jit
def _stage_inputs(a_ptr, a64_ptr, xs_ptr, word_start, word_end, K, ASM: tl.constexpr,
                  X_BF16: tl.constexpr, GATED: tl.constexpr, WORDS: tl.constexpr,
                  ROWS: tl.constexpr):
    """Write the inputs of word rows [word_start, word_end) (word_start a multiple of WORDS) as
    the K loop reads them: with ASM four fp16 pair bits per row at xs_ptr + 4 w, else the eight
    float32 values at xs_ptr + 8 w; and each K block's (WORDS rows') input sum, float32, at
    xs_ptr + K + block, the sum of the values as the loop multiplies them (fp16-rounded with
    ASM). ROWS word rows at a time."""
    BLOCKS: tl.constexpr = ROWS // WORDS
    for r0 in range(word_start, word_end, ROWS):
        word = r0 + tl.arange(0, ROWS)  # (ROWS,)
        w_mask = (word < word_end) & (word < K // 8)
        if GATED:
            x0, x1, x2, x3, x4, x5, x6, x7 = _gated_word_inputs(a_ptr, word, w_mask, K, False,
                                                                ROWS)
        else:
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_word_inputs(a_ptr, a64_ptr, word, w_mask,
                                                            X_BF16, False)
        if ASM:
            tl.store(xs_ptr + word * 4, _pair(x4, x0), mask=w_mask)
            tl.store(xs_ptr + word * 4 + 1, _pair(x5, x1), mask=w_mask)
            tl.store(xs_ptr + word * 4 + 2, _pair(x6, x2), mask=w_mask)
            tl.store(xs_ptr + word * 4 + 3, _pair(x7, x3), mask=w_mask)
            x0 = x0.to(tl.float16).to(tl.float32)
            x1 = x1.to(tl.float16).to(tl.float32)
            x2 = x2.to(tl.float16).to(tl.float32)
            x3 = x3.to(tl.float16).to(tl.float32)
            x4 = x4.to(tl.float16).to(tl.float32)
            x5 = x5.to(tl.float16).to(tl.float32)
            x6 = x6.to(tl.float16).to(tl.float32)
            x7 = x7.to(tl.float16).to(tl.float32)
        else:
            f_ptr = xs_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
            tl.store(f_ptr + word * 8, x0, mask=w_mask)
            tl.store(f_ptr + word * 8 + 1, x1, mask=w_mask)
            tl.store(f_ptr + word * 8 + 2, x2, mask=w_mask)
            tl.store(f_ptr + word * 8 + 3, x3, mask=w_mask)
            tl.store(f_ptr + word * 8 + 4, x4, mask=w_mask)
            tl.store(f_ptr + word * 8 + 5, x5, mask=w_mask)
            tl.store(f_ptr + word * 8 + 6, x6, mask=w_mask)
            tl.store(f_ptr + word * 8 + 7, x7, mask=w_mask)
        row_sums = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))  # (ROWS,), zero off mask
        block_sums = tl.sum(tl.reshape(row_sums, (BLOCKS, WORDS)), axis=1)  # (BLOCKS,)
        first = r0 + tl.arange(0, BLOCKS) * WORDS  # each block's first word row
        s_ptr = xs_ptr.to(tl.pointer_type(tl.float32), bitcast=True) + K
        tl.store(s_ptr + first // WORDS, block_sums, mask=(first < word_end) & (first < K // 8))


@triton.jit
def _staged_block(q_ptr, s_ptr, z_ptr, k0, K, N, offs_w, offs_n, n_mask, k_end,
                  GROUP: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K block at k0's words (W, BN) int32; its scales in the words' layout (W, BN) (every
    row the same) and, in a layout of their own, its scales and zero points (BN,), float32;
    nothing is read from k_end (this program's end) or K on (zero words and scales)."""
    word = k0 // 8 + offs_w  # (W,)
    w_mask = (word < K // 8) & (word < k_end // 8)
    words = tl.load(q_ptr + word.to(tl.int64)[:, None] * N + offs_n[None, :],
                    mask=w_mask[:, None] & n_mask[None, :], other=0)
    grp = tl.minimum(k0, K - 1) // GROUP
    s_mask = n_mask & ((offs_n * 0 + k0) < k_end) & ((offs_n * 0 + k0) < K)
    s_rows = tl.load(s_ptr + grp * N + offs_n[None, :] + offs_w[:, None] * 0,
                     mask=s_mask[None, :] & (offs_w >= 0)[:, None], other=0.0).to(tl.float32)
    s = tl.load(s_ptr + grp * N + offs_n, mask=s_mask, other=0.0).to(tl.float32)
    if HAS_ZP:
        z = tl.load(z_ptr + grp * N + offs_n, mask=s_mask, other=0.0).to(tl.float32)
    else:
        z = tl.full(offs_n.shape, 8.0, tl.float32)
    return words, s_rows, s, z


@triton.jit
def _staged_sums(words, xs_ptr, word, w_mask, ASM: tl.constexpr):
    """(W, BN) float32: each word's sum_j q_j x[8 w + j] (x as staged, zero off w_mask)."""
    if ASM:
        p0 = tl.load(xs_ptr + word * 4, mask=w_mask, other=0)[:, None]  # (W, 1)
        p1 = tl.load(xs_ptr + word * 4 + 1, mask=w_mask, other=0)[:, None]
        p2 = tl.load(xs_ptr + word * 4 + 2, mask=w_mask, other=0)[:, None]
        p3 = tl.load(xs_ptr + word * 4 + 3, mask=w_mask, other=0)[:, None]
        t = tl.inline_asm_elementwise(ASM_DOT_U4_NZ, "=r,r,r,r,r,r", [words, p0, p1, p2, p3],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        f_ptr = xs_ptr.to(tl.pointer_type(tl.float32), bitcast=True) + word * 8
        t = (words & 0xF).to(tl.float32) * tl.load(f_ptr, mask=w_mask, other=0.0)[:, None]
        for j in tl.static_range(1, 8):
            t += (((words >> (4 * j)) & 0xF).to(tl.float32)
                  * tl.load(f_ptr + j, mask=w_mask, other=0.0)[:, None])
    return t


@triton.jit(do_not_specialize=["stride_cm", "K_ITERS", "SPLIT_K"])
def _wna16_gemv_staged_kernel(
    a_ptr, a64_ptr, q_ptr, s_ptr, z_ptr, part_ptr, lock_ptr, c_ptr, xs_ptr,
    M, N, K, stride_cm, K_ITERS, SPLIT_K,
    GROUP: tl.constexpr, HAS_ZP: tl.constexpr, ASM: tl.constexpr, X_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SPLIT: tl.constexpr, PDL: tl.constexpr,
    GATED: tl.constexpr, STAGE_ROWS: tl.constexpr,
):
    """y (BN,) of one row; GATED: x is silu(h[:K]) * h[K:] of the row h (2K,) at a_ptr. xs_ptr:
    int32 scratch of K + K / BLOCK_K entries. Each K block's loads are issued one block ahead."""
    WORDS: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WORDS)  # (W,)
    acc = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    zx = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum over blocks of s z (block's input sum)
    k_start = split * K_ITERS * BLOCK_K
    k_end = (split + 1) * K_ITERS * BLOCK_K  # this program's K range ends here
    nxt = _staged_block(q_ptr, s_ptr, z_ptr, k_start, K, N, offs_w, offs_n, n_mask, k_end,
                        GROUP, HAS_ZP, BLOCK_K)
    pdl_wait(PDL)  # the first block's weights (constant) are read before it, x after
    _stage_inputs(a_ptr, a64_ptr, xs_ptr, k_start // 8, k_end // 8, K, ASM, X_BF16, GATED,
                  WORDS, STAGE_ROWS)
    tl.debug_barrier()  # this program's staged inputs are visible to all its threads
    sums_ptr = xs_ptr.to(tl.pointer_type(tl.float32), bitcast=True) + K
    for it in range(0, K_ITERS):
        k0 = k_start + it * BLOCK_K
        words, s_rows, s, z = nxt
        nxt = _staged_block(q_ptr, s_ptr, z_ptr, k0 + BLOCK_K, K, N, offs_w, offs_n, n_mask,
                            k_end, GROUP, HAS_ZP, BLOCK_K)
        word = k0 // 8 + offs_w  # (W,)
        w_mask = word < K // 8
        acc += _staged_sums(words, xs_ptr, word, w_mask, ASM) * s_rows
        x_sum = tl.load(sums_ptr + k0 // BLOCK_K, mask=k0 < K, other=0.0)
        zx += s * z * x_sum
    pdl_release(PDL)
    val = (tl.sum(acc, axis=0) - zx) * _UNDO
    store_partial(part_ptr, c_ptr, val, 0, M, N, split, offs_n, n_mask, stride_cm, HAS_SPLIT)
    finish_split_k(part_ptr, lock_ptr, c_ptr, M, N, pid_n, offs_n, n_mask, stride_cm, SPLIT_K,
                   HAS_SPLIT, 1, BLOCK_N)
