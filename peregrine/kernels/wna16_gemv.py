"""Split-K GEMV for weight-only int weights in layers/quantization/wna16.py's layout, for decode
batches of at most GEMV_MAX_ROWS rows: y (M, N) = x (M, K) @ dequant(W) (K, N). Variants, chosen
by wna16_gemv's `variant` argument; without one, tc for up to 8 rows of 4- or 6-bit weights and
16-bit x on a CUDA GPU where its shapes allow (else half2_prefetch at one row), inplace or
inplace_prefetch where they read the layout (4-bit weights; 8-bit up to 2 rows; see _variant for
which), else fma:

tc (4 or 6 bits, 1-8 rows, groups of a multiple of 128 inputs, sm_80+; wna16_gemv_tc.py, Gluon):
the 16x8x16 tensor-core MMA with every operand in registers, each lane reading its words and
inputs straight into the registers the MMA takes them from (x's rows are B's columns); ~16
instructions a 4-bit word against ~30 for half2_prefetch. One warp of 32 channels a program, the
K split to fill ~15 programs per SM, the weights and inputs four 32-input steps ahead. A gated
down projection is not fused by default (every lane would compute SiLU-and-mul; _TC_GATED).

half2 (4 bits, one row, K blocks inside one group; wna16_gemv_half2.py): two values per
instruction in fp16 pairs (dequantization and the products), the word's sum in float32;
half2_prefetch loads each K block one iteration ahead, half2_prefetch2 two; half2_async lets
the compiler copy the words into shared memory asynchronously (cp.async), the config's
num_stages blocks in flight. half2_staged (wna16_gemv_staged.py): x converted once per program
into a scratch buffer and the zero point taken out of the K loop, on 512-column tiles.

inplace (4 / 8 bits, K blocks inside one group; wna16_gemv_inplace.py): each value becomes a
float where it sits in its word, so a 4-bit value costs an AND-OR, a subtraction and an FMA.

fma (every layout): per K block it loads the (BLOCK_K / pack, BLOCK_N) packed int32
words once (rows of N contiguous words: coalesced), and for each of the pack values a word holds
takes a shift and a mask in registers. An integer q < 2^23 becomes the float 2^23 + q by OR-ing
it into the mantissa of 2^23, so q - zero is one float subtraction of (2^23 + zero). Each row m
keeps a (words, BLOCK_N) float32 accumulator in the words' own layout: acc_m += scale * sum_j
(q_j - zero) * x[m, k_j], so nothing crosses threads until the end, where one reduction over the
words gives the row's sums. fma_prefetch: the same, with the K loop software-pipelined by the
compiler (each block's words copied to shared memory two iterations ahead: more bytes in flight).

mma (4 / 8-bit weights, 16-bit activations, sm_90+ on CUDA): per K block each program
dequantizes its (BLOCK_N columns, BLOCK_K inputs) tile to exact 16-bit q - zero with a few
inline-PTX bit tricks on whole words (4-bit: shift, lop3 into the exponent of 128 / 1024, one
packed subtraction of (magic + zero) per two values; 8-bit fp16 the same with a byte prmt; 8-bit
bf16 through float32 2^23 + q), and one tl.dot multiplies it by x^T padded to 16 columns: the
weight is the dot's first operand, so the padding costs x, not the weight, and every row count up
to 16 runs the same instructions. The interpreter gets the same values from plain Triton ops.

SASS per weight value in the K loop, compiled for sm_90 (benchmarks/gemv_sass.py): fma 4-bit with
zero points 6.6 / 9.0 / 12.3 at 1 / 2 / 4 rows, 8-bit 6.4 at 1 row; mma 4-bit 2.7, 8-bit fp16
2.7, 8-bit bf16 4.9 at any row count. Yet on an H200 at Llama-3-8B shapes mma took about twice
fma's time (M = 1 and 4): neither is issue-bound there; both wait on memory latency (too few
bytes in flight), which is what fma_prefetch addresses; fma_prefetch then measured no faster
than fma, while inplace (4.9 per 4-bit value at 1 row) took a quarter less time than fma, so the
FMA kernels are bound by the instructions they issue. Split-K partials are combined as in
gemv.py (deterministic). Act-order (g_idx) weights use the GEMM (wna16_gemm.py).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from peregrine import envs
from peregrine.kernels._utils import dot_dtype, pdl_args, pdl_release, pdl_wait
from peregrine.kernels.gemv import (GEMV_MAX_M, GemvConfig, _sms, block_m_for, choose_split,
                                    launch_buffers, one_wave_split, row_accumulators,
                                    store_row_sums)
from peregrine.kernels.wna16_gemv_half2 import _wna16_gemv_half2_kernel
from peregrine.kernels.wna16_gemv_inplace import _wna16_gemv_inplace_kernel
from peregrine.kernels.wna16_gemv_mma import _wna16_gemv_mma_kernel
from peregrine.kernels.wna16_gemv_staged import _wna16_gemv_staged_kernel

if TYPE_CHECKING:
    from peregrine.layers.quantization.wna16 import WNA16Layout

_MAGIC = 0x4B000000  # the bits of 2^23 as float32


@triton.jit
def _x_col(a_ptr, m, M, stride_am, kk, k_mask):
    """x[m, kk] for the words' rows (WORDS,), float32, zero past row M."""
    row_ok = (kk * 0 + m) < M
    return tl.load(a_ptr + m * stride_am + kk, mask=k_mask & row_ok, other=0.0).to(tl.float32)


@triton.jit
def _fma_block(q_ptr, qhi_ptr, s_ptr, z_ptr, k0, K, N, offs_w, offs_n, n_mask,
               GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZP: tl.constexpr,
               PER_WORD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K block at k0's loads: (W, BN) words, the 6-bit high words (else the words again),
    float32 scales and 2^23 + zero points, (W, BN) per word row or (1, BN) for the block.
    Past K nothing is read (masked words; the last group's scales)."""
    PACK: tl.constexpr = 4 if BITS == 8 else 8
    WORDS: tl.constexpr = BLOCK_K // PACK
    half: tl.constexpr = 1 << (BITS - 1)
    word = k0 // PACK + offs_w  # (W,) word rows of the main plane
    tile_mask = (word < K // PACK)[:, None] & n_mask[None, :]
    words = tl.load(q_ptr + word.to(tl.int64)[:, None] * N + offs_n[None, :], mask=tile_mask,
                    other=0)  # (W, BN) int32
    hi = words
    if BITS == 6:  # the high 2 bits: 16 per word, so word row w's values sit at half w // 2
        hi = tl.load(qhi_ptr + (word // 2).to(tl.int64)[:, None] * N + offs_n[None, :],
                     mask=tile_mask, other=0)  # (W, BN) int32
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
        grp = tl.minimum(k0, K - 1) // GROUP
        s = tl.load(s_ptr + grp * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_ZP:
            z = tl.load(z_ptr + grp * N + offs_n, mask=n_mask,
                        other=0.0).to(tl.float32)[None, :] + 8388608.0  # (1, BN)
        else:
            z = tl.full((1, BLOCK_N), 8388608.0 + half, tl.float32)
    return words, hi, s, z


@triton.jit(do_not_specialize=["M", "stride_am", "stride_cm", "K_ITERS", "SPLIT_K"])
def _wna16_gemv_fma_kernel(
    a_ptr, q_ptr, qhi_ptr, s_ptr, z_ptr, part_ptr, lock_ptr, c_ptr,
    M, N, K, stride_am, stride_cm, K_ITERS, SPLIT_K,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZP: tl.constexpr, PER_WORD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    PACK: tl.constexpr = 4 if BITS == 8 else 8  # values per word of the main plane
    WIDTH: tl.constexpr = 8 if BITS == 8 else 4  # bits per value in the main plane
    WORDS: tl.constexpr = BLOCK_K // PACK
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WORDS)  # (W,)
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = row_accumulators(WORDS, BLOCK_N)
    # NOTE: with PREFETCH the compiler's software pipeliner copies each K block's words into
    # shared memory (cp.async) two iterations ahead; without it the loads are issued in the loop.
    for it in tl.range(0, K_ITERS, num_stages=3 if PREFETCH else 1):
        k0 = (split * K_ITERS + it) * BLOCK_K
        word = k0 // PACK + offs_w  # (W,) word rows of the main plane
        w_mask = word < K // PACK
        words, hi, s, z = _fma_block(q_ptr, qhi_ptr, s_ptr, z_ptr, k0, K, N, offs_w, offs_n,
                                     n_mask, GROUP, BITS, HAS_ZP, PER_WORD, BLOCK_N, BLOCK_K)
        if BITS == 6:
            hi_base = ((word % 2) * 16)[:, None]  # (W, 1) the half of hi's word holding row w
        t0, t1, t2, t3, t4, t5, t6, t7 = row_accumulators(WORDS, BLOCK_N)
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
    pdl_release(PDL)
    store_row_sums(part_ptr, lock_ptr, c_ptr, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, M,
                   N, pid_n, split, offs_n, n_mask, stride_cm, SPLIT_K, HAS_SPLIT, BLOCK_M,
                   BLOCK_N)


# fma: 16 rows of 64 words per K block. Compiled for sm_90 (4-bit, zero points): 4 warps at 1 /
# 2 / 4 rows take 56 / 89 / 128 registers and about 6.6 / 8.9 / 12.3 instructions per weight
# value in the K loop; 8 rows take 8 warps (169 registers, 22.7 per value) where 4 would use all
# 255. mma: 128 columns x 128 inputs per K block, 4 warps, any row count up to _MMA_ROWS.
_WORDS = 16
_BLOCK_N = 64
_MMA_BLOCK_N = 128
_MMA_BLOCK_K = 128
VARIANTS = ("fma", "fma_prefetch", "mma", "inplace", "inplace_prefetch", "half2",
            "half2_prefetch", "half2_prefetch_x", "half2_pair", "half2_prefetch2", "half2_async",
            "half2_staged", "tc")
_ASYNC_STAGES = 4
_ASYNC_BLOCK_N = 128
_ASYNC_WAVES = 2.0
# K blocks loaded ahead into registers (half2_async: none; the pipeliner's stages instead)
_HALF2_AHEAD = {"half2": 0, "half2_prefetch": 1, "half2_prefetch_x": 1, "half2_pair": 1,
                "half2_prefetch2": 2, "half2_async": 0, "half2_staged": 1}
# The packed-half variants' tile and split: 128 columns, at least _HALF2_WAVES programs per SM
# and at most _HALF2_K_ITERS K blocks each. On an H200 at Llama-3-8B's shapes (one row, group
# 128) this beat 64 columns at 3.5 programs per SM by 8% over a layer's four GEMVs (56.0 against
# 60.8 us; the best of a 162-config grid per shape summed to 55.1).
_HALF2_BLOCK_N = 128
_HALF2_WAVES = 2.9
_HALF2_K_ITERS = 8
_INPLACE_WAVES = 3.5
# The staged variant's tile: 512 columns, at least _STAGED_WAVES programs per SM, at most
# _HALF2_K_ITERS K blocks each. On an H200 at Llama-3-8B's gate/up projection (one row) that
# took 24.1 us against the packed-half variant's 27.5, yet batch-1 decode with it there was no
# faster (407.8 against 407.7 tok/s); at the other projections it was slower (13.1 / 8.4 / 15.2
# us at qkv / o / down against 9.0 / 6.8 / 14.3). It is not a default.
_STAGED_BLOCK_N = 512
_STAGED_WAVES = 1.5
# The tensor-core variant (wna16_gemv_tc.py): programs of _TC_WARPS warps of 16 * _TC_V channels,
# K split (into whole groups of 128 inputs) until at least _TC_WAVES programs run per SM, the
# weights _TC_AHEAD steps (32 inputs each) and the inputs _TC_X_AHEAD steps ahead of the MMAs.
_TC_V = 2
# Rows the variant takes (B's 8 columns) and, of those, the most that the default sends to it.
# On an H200 at Llama-3-8B's shapes (int4) it took 9.2 / 10.2 / 12.5 us at qkv for 2 / 4 / 8
# rows against 13.5 / 18.3 / 50.4 for the default before it, and gate_up 24.2 us at 8 rows
# against the GEMM's ~131: layouts it serves take the GEMV up to 8 rows (max_rows).
_TC_MAX_ROWS = 8
_TC_ROWS = 8
_TC_WARPS = 1
_TC_WAVES = 15.0
_TC_AHEAD = 4
_TC_X_AHEAD = 4
# Whether a down projection's one gate-and-up row takes the tensor-core variant gated (SiLU-and-
# mul computed by every lane as it reads its inputs) when that variant is the one-row choice;
# else the activation kernel runs first.
_TC_GATED = False
# One row of 4-bit weights: the K split is then raised to the largest divisor of the groups whose
# programs stay within this many per SM (one wave at that kernel's 66-70 registers); 0 keeps the
# rule above. Llama-3-8B's down projection (112 groups, 128 tiles) then takes 28 splits, not 16:
# 12.7-12.9 us a call against 14.0-14.1 on an H200, W5 batch-1 decode 469.7 / 469.5 and 469.1
# against 467.5 / 467.3 and 466.3 tok/s; its other projections keep their splits. 6-bit weights
# (more registers) lost with it (int6 RTN 358.1 against 364.5), so they keep the rule above.
_TC_ONE_ROW_PER_SM = 28
# The variants that take a gate-and-up row and compute SiLU-and-mul as they read it.
_GATED_VARIANTS = (*_HALF2_AHEAD, "tc")


def _block_k(bits: int) -> int:
    return _WORDS * (4 if bits == 8 else 8)


def gemv_supported(w: WNA16Layout, block_k: int | None = None) -> bool:
    """Whether the (fma) GEMV reads this layout: no act-order, and every K block either inside
    one group or made of whole words of each group. The mma variant takes a subset."""
    if w.g_idx is not None:
        return False
    bk = block_k or _block_k(w.bits)
    pack = 4 if w.bits == 8 else 8
    g = w.group_size
    return g % bk == 0 or g == w.in_features or (bk % g == 0 and g % pack == 0)


def _inplace_block_k(w: WNA16Layout) -> int:
    """The in-place variant's K block: the fma block, or the group when it is smaller (one
    scale and zero per block); 0 when no block of whole words fits the groups."""
    bk, pack = _block_k(w.bits), 32 // w.bits
    while bk >= pack:
        if w.group_size % bk == 0 or w.group_size == w.in_features:
            return bk
        bk //= 2
    return 0


def _half2_block_k(w: WNA16Layout) -> int:
    """The packed-half variants' K block: the in-place one at 4 bits; at 6 bits 128 inputs or
    the group when it is smaller, whole 16-value high-bits words (0 when none fits)."""
    if w.bits != 6:
        return _inplace_block_k(w)
    bk = 128
    while bk >= 16:
        if w.group_size % bk == 0 or w.group_size == w.in_features:
            return bk
        bk //= 2
    return 0


def half2_supported(w: WNA16Layout, block_k: int | None = None) -> bool:
    """Whether the packed-half variants serve this layout: 4 or 6 bits, no act-order, K blocks
    of whole words (6 bits: whole high-bits words) inside one group."""
    if w.g_idx is not None or w.bits not in (4, 6):
        return False
    bk = block_k or _half2_block_k(w)
    need = 16 if w.bits == 6 else 8
    return (bk >= need and bk % need == 0
            and (w.group_size % bk == 0 or w.group_size == w.in_features))


def _tc_layout_ok(w: WNA16Layout, dtype: torch.dtype) -> bool:
    """The tensor-core variant's needs of the layout and the activation dtype: 4 or 6 bits
    without act-order, groups of a multiple of 128 inputs, N a multiple of 8, 16-bit x,
    16-byte aligned weights on a CUDA GPU (sm_80+)."""
    tensors = (w.qweight, w.scales) + tuple(t for t in (w.zeros, w.qweight_hi) if t is not None)
    dev = w.qweight.device
    return (w.bits in (4, 6) and w.g_idx is None and w.in_features % 128 == 0
            and w.group_size % 128 == 0 and w.out_features % 8 == 0
            and dtype in (torch.bfloat16, torch.float16) and w.qweight.is_cuda
            and _is_sm80_or_later(dev.index if dev.index is not None
                                  else torch.cuda.current_device())
            and all(t.data_ptr() % 16 == 0 for t in tensors))


def tc_supported(w: WNA16Layout, x: torch.Tensor) -> bool:
    """Whether the tensor-core variant serves the rows x (M, K) of this layout: at most
    _TC_MAX_ROWS rows 16-byte aligned on the layout's device, and the layout's needs
    (_tc_layout_ok)."""
    return (x.dim() == 2 and x.shape[0] <= _TC_MAX_ROWS and x.stride(-1) == 1
            and (x.shape[0] == 1 or x.stride(0) % 8 == 0) and x.data_ptr() % 16 == 0
            and x.device == w.qweight.device and _tc_layout_ok(w, x.dtype))


def max_rows(w: WNA16Layout, dtype: torch.dtype) -> int:
    """The most rows of dtype activations that take the GEMV rather than the GEMM: _TC_ROWS
    where the tensor-core variant serves the layout, else GEMV_MAX_M."""
    if _TC_ROWS > GEMV_MAX_M and _tc_layout_ok(w, dtype):
        return min(_TC_ROWS, _TC_MAX_ROWS)
    return GEMV_MAX_M


def tc_config(w: WNA16Layout, device: torch.device, rows: int = 1) -> GemvConfig:
    """The tensor-core variant's launch: block_n = the program's channels (_TC_WARPS warps of
    16 * _TC_V), block_k 128 (one chunk), the K split a divisor of the chunks."""
    block_n = 16 * _TC_V * _TC_WARPS
    chunks = w.in_features // 128
    tiles = triton.cdiv(w.out_features, block_n)
    split, _ = choose_split(tiles, chunks, device, _TC_WAVES)
    while chunks % split:
        split -= 1
    if rows == 1 and w.bits == 4 and _TC_ONE_ROW_PER_SM:
        split = one_wave_split(tiles, chunks, _TC_ONE_ROW_PER_SM * _sms(device), split)
    return GemvConfig(block_n, 128, split, chunks // split, _TC_WARPS)


def inplace_supported(w: WNA16Layout, block_k: int | None = None) -> bool:
    """Whether the in-place variant serves this layout: 4 or 8 bits, no act-order, K blocks of
    whole words inside one group."""
    if w.g_idx is not None or w.bits not in (4, 8):
        return False
    bk = block_k or _inplace_block_k(w)
    return bk >= 32 // w.bits and (w.group_size % bk == 0 or w.group_size == w.in_features)


def _mma_block_k(w: WNA16Layout) -> int:
    """The mma variant's K block: 128 inputs, or the group when it is smaller (one scale and
    zero per block); 0 when no block of 16+ inputs fits the groups."""
    bk = _MMA_BLOCK_K
    while bk >= 16:
        if w.group_size % bk == 0 or w.group_size == w.in_features:
            return bk
        bk //= 2
    return 0


def mma_supported(w: WNA16Layout, dtype: torch.dtype, device: torch.device,
                  block_k: int | None = None) -> bool:
    """Whether the tensor-core variant serves this layout for activations of `dtype`: 4 or 8
    bits, no act-order, 16-bit activations, K blocks inside one group, and on CUDA sm_90+
    (packed bf16 arithmetic; the interpreter runs it anywhere)."""
    if w.g_idx is not None or w.bits not in (4, 8):
        return False
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    bk = block_k or _mma_block_k(w)
    if bk < 16 or not (w.group_size % bk == 0 or w.group_size == w.in_features):
        return False
    if device.type != "cuda":
        return True
    return _is_sm90_or_later(device.index if device.index is not None
                             else torch.cuda.current_device())


@functools.lru_cache(maxsize=8)
def _is_sm80_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)


@functools.lru_cache(maxsize=8)
def _is_sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


@functools.lru_cache(maxsize=1)
def _one_row_variant() -> str | None:
    """PEREGRINE_WNA16_GEMV's variant for one row of 4-bit weights (None: the default)."""
    chosen = envs.wna16_gemv_variant()
    if chosen is not None and chosen not in VARIANTS:
        raise ValueError(f"PEREGRINE_WNA16_GEMV: unknown variant {chosen!r} (known: "
                         f"{VARIANTS})")
    return chosen


def _variant(w: WNA16Layout, x: torch.Tensor, variant: str | None,
             config: GemvConfig | None) -> str:
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"wna16_gemv: unknown variant {variant!r} (known: {VARIANTS})")
    block_k = config.block_k if config is not None else None
    ok = mma_supported(w, x.dtype, x.device, block_k)
    if variant == "mma" and not ok:
        raise ValueError(f"wna16_gemv: the mma variant takes 4 / 8-bit weights without act-order, "
                         f"16-bit activations and K blocks inside one group (sm_90+ on CUDA); "
                         f"got {w.bits} bits, {x.dtype}, group {w.group_size}, block_k "
                         f"{block_k or _mma_block_k(w)}")
    if variant in _HALF2_AHEAD and not (
            x.shape[0] == 1 and half2_supported(w, block_k)
            and (w.bits == 4 or variant != "half2_staged")):
        raise ValueError(f"wna16_gemv: the half2 variant takes one row of x and 4-bit weights "
                         f"(6-bit ones but for half2_staged) without act-order, K blocks inside "
                         f"one group; got {x.shape[0]} rows, {w.bits} bits, group "
                         f"{w.group_size}")
    if variant == "tc" and not tc_supported(w, x):
        raise ValueError(f"wna16_gemv: the tc variant takes at most {_TC_MAX_ROWS} rows of "
                         f"16-bit x and 4- or 6-bit weights in groups of a multiple of 128 inputs "
                         f"without act-order, N a multiple of 8, 16-byte aligned tensors, on a "
                         f"CUDA GPU (sm_80+); got {x.shape[0]} rows, {x.dtype}, {w.bits} bits, "
                         f"group {w.group_size}, N {w.out_features}")
    if variant in ("inplace", "inplace_prefetch") and not inplace_supported(w, block_k):
        raise ValueError(f"wna16_gemv: the inplace variant takes 4 / 8-bit weights without "
                         f"act-order and K blocks inside one group; got {w.bits} bits, group "
                         f"{w.group_size}, block_k {block_k or _inplace_block_k(w)}")
    if variant is not None:
        return variant
    # The in-place variant measured faster on an H200 at Llama-3-8B's shapes for 4-bit weights
    # (one layer's four GEMVs at 1 / 2 / 4 rows: 71 / 97 / 161 us against fma's 93 / 110 / 170)
    # and for 8-bit weights up to 2 rows (93 / 109 against 99 / 122; 192 against 170 at 4).
    # Its prefetching form took 146 us at 4 rows of 4-bit weights and 84 us at 1 row of 8-bit
    # ones, but 74 us at 1 row of 4-bit weights and 131 us at 2 rows of 8-bit ones.
    # One row of 4-bit weights and 16-bit x: the tensor-core form where it runs (Llama-3-8B int4
    # batch-1 decode on an H200 445.0 / 445.3 tok/s against 405.4 / 405.6), else the packed-half
    # form with its loads a block ahead (369.7 against 343.4 in place).
    rows = x.shape[0]
    if (rows == 1 and w.bits == 4 and x.dtype in (torch.bfloat16, torch.float16)
            and inplace_supported(w, block_k)):
        chosen = _one_row_variant()
        if (chosen == "mma" and not ok) or (chosen == "tc" and not tc_supported(w, x)):
            chosen = None
        if chosen is None and tc_supported(w, x):
            chosen = "tc"
        return chosen or "half2_prefetch"
    if 1 < rows <= _TC_ROWS and tc_supported(w, x):
        return "tc"
    # One row of 6-bit weights: the tensor-core form where it runs (Llama-3-8B int6 RTN batch-1
    # decode on an H200 362.3 tok/s against 344.1), else the packed-half one (the high bits
    # OR-ed into the pairs).
    if (rows == 1 and w.bits == 6 and x.dtype in (torch.bfloat16, torch.float16)
            and half2_supported(w, block_k)):
        chosen = _one_row_variant()
        return "tc" if chosen in (None, "tc") and tc_supported(w, x) else "half2_prefetch"
    if not inplace_supported(w, block_k) or (w.bits == 8 and rows > 2):
        return "fma"
    if (w.bits == 4 and rows > 2) or (w.bits == 8 and rows == 1):
        return "inplace_prefetch"
    return "inplace"


def gemv_config(w: WNA16Layout, device: torch.device, block_m: int = 1,
                variant: str = "fma") -> GemvConfig:
    """fma and inplace: 64 output columns (256 bytes of words per row) per program; half2: 128;
    mma: 128 columns x 128 inputs (or the group) per K block. K split to fill the SMs."""
    if variant == "mma":
        block_n, block_k, warps = _MMA_BLOCK_N, _mma_block_k(w), 4
    elif variant == "half2_async":
        block_n, block_k, warps = _ASYNC_BLOCK_N, _half2_block_k(w), 4
    elif variant == "half2_staged":
        block_n, block_k, warps = _STAGED_BLOCK_N, _inplace_block_k(w), 4
    elif variant.startswith("half2"):
        block_n, block_k, warps = _HALF2_BLOCK_N, _half2_block_k(w), 4
    elif variant.startswith("inplace"):
        block_n, block_k, warps = _BLOCK_N, _inplace_block_k(w), 8 if block_m > 4 else 4
    else:
        block_n, block_k, warps = _BLOCK_N, _block_k(w.bits), 8 if block_m > 4 else 4
    tiles = triton.cdiv(w.out_features, block_n)
    # NOTE: the in-place variant aims at 3.5 programs per SM: at Llama-3-8B's o and down
    # projections (64 column tiles) 8 splits (512 programs) took 8.2 / 18.6 us on an H200 where
    # 16 (1,024, what 4 per SM asks for) took 9.4 / 19.6.
    kw = {"waves": _INPLACE_WAVES} if variant.startswith("inplace") else {}
    if variant.startswith("half2"):
        kw = {"waves": _HALF2_WAVES, "max_k_iters": _HALF2_K_ITERS}
    if variant == "half2_async":
        kw = {"waves": _ASYNC_WAVES}
    if variant == "half2_staged":
        kw = {"waves": _STAGED_WAVES, "max_k_iters": _HALF2_K_ITERS}
    split, k_iters = choose_split(tiles, triton.cdiv(w.in_features, block_k), device, **kw)
    stages = _ASYNC_STAGES if variant == "half2_async" else 1
    return GemvConfig(block_n, block_k, split, k_iters, warps, stages)


def gated_supported(w: WNA16Layout, h: torch.Tensor) -> bool:
    """Whether wna16_gemv(h, w, gated=True) serves the gate-and-up rows h (..., 2K): one row of
    16-bit activations whose default variant is a packed-half one read through registers."""
    if h.shape[-1] != 2 * w.in_features:
        return False
    rows = h.numel() // max(h.shape[-1], 1)
    if rows != 1 or h.dtype not in (torch.bfloat16, torch.float16):
        return False
    kind = _variant(w, h.reshape(1, -1), None, None)
    return kind in _HALF2_AHEAD or (kind == "tc" and _TC_GATED)


def wna16_gemv(x: torch.Tensor, w: WNA16Layout, config: GemvConfig | None = None,
               variant: str | None = None, gated: bool = False) -> torch.Tensor:
    """y (..., N) = x (..., K) @ dequant(w) (K, N) in x's dtype, for at most GEMV_MAX_ROWS rows.
    variant: "inplace" (4 / 8 bits, values converted in place), "half2" / "half2_prefetch" /
    "half2_prefetch2" (4 bits, one row, fp16 pairs; K blocks loaded 0 / 1 / 2 ahead),
    "half2_prefetch_x" (as half2_prefetch, bf16 x loaded a block ahead with the weights),
    "half2_pair" (as half2_prefetch at 4 bits, two word rows of a column summed in fp16 lanes
    before their one float32 sum),
    "half2_async" (the same, blocks streamed through shared memory by asynchronous copies),
    "half2_staged" (the same sums with x staged once per program, the zero point outside the
    K loop), "fma" (float32 FMAs), "fma_prefetch" (the same, its loads
    pipelined two K blocks ahead) or "mma" (tensor cores; 4 / 8 bits, 16-bit x, sm_90+); None:
    tc for up to 8 rows of 4- or 6-bit weights and 16-bit x where it runs (tc_supported), else
    half2_prefetch at one row, else one of the in-place forms for 4-bit weights and for 8-bit
    ones up to 2 rows where the layout allows (the prefetching one at 3-4 rows of 4-bit and 1
    row of 8-bit weights), else fma.
    gated: x is a gate-and-up row h (1, 2K) and the GEMV's input silu(h[:K]) * h[K:], computed
    as it is read (rounded to h's dtype, as silu_and_mul would): a packed-half variant read
    through registers only."""
    k, n = w.in_features, w.out_features
    width = 2 * k if gated else k
    if x.shape[-1] != width:
        raise ValueError(f"wna16_gemv: x has {x.shape[-1]} inputs, the weight {k}"
                         f"{' (gated: twice that)' if gated else ''}")
    lead = x.shape[:-1]
    a = x.reshape(-1, width).contiguous()  # (M, K) or (M, 2K), rows width apart
    m = a.shape[0]
    bm = block_m_for(m)
    kind = _variant(w, a, variant, config)
    if gated and kind not in _GATED_VARIANTS:
        raise ValueError(f"wna16_gemv: gated inputs take a variant read through registers "
                         f"({', '.join(_GATED_VARIANTS)}); got {kind}")
    if kind == "tc":
        return _tc_launch(a, w, config or tc_config(w, x.device, m), gated).reshape(*lead, n)
    cfg = config or gemv_config(w, x.device, bm, kind)
    if cfg.block_k & (cfg.block_k - 1) or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"wna16_gemv: block_k {cfg.block_k} and block_n {cfg.block_n} must be "
                         "powers of two")
    inplace = kind in ("inplace", "inplace_prefetch") or kind in _HALF2_AHEAD
    if not inplace and not gemv_supported(w, cfg.block_k):
        raise ValueError(f"wna16_gemv: group size {w.group_size} (act-order: "
                         f"{w.g_idx is not None}) does not fit K blocks of {cfg.block_k}")
    if cfg.block_k % (16 if w.bits == 6 else 32 // w.bits):
        raise ValueError(f"wna16_gemv: block_k {cfg.block_k} is not whole words of {w.bits} bits")
    if cfg.split_k * cfg.k_iters * cfg.block_k < k:
        raise ValueError(f"wna16_gemv: {cfg.split_k} splits x {cfg.k_iters} blocks of "
                         f"{cfg.block_k} do not cover the {k} inputs")
    tiles = triton.cdiv(n, cfg.block_n)
    out, part, lock = launch_buffers(a, n, tiles, cfg.split_k)
    q = w.qweight
    zeros = w.zeros if w.zeros is not None else w.scales
    # bf16 x is read 4 values per 8-byte load where its rows allow it.
    x_bf16 = (a.dtype == torch.bfloat16 and a.data_ptr() % 8 == 0 and k % 4 == 0
              and not gated)
    if kind == "half2_staged":
        # scratch: the staged inputs (K entries) and each K block's input sum
        xs = torch.empty(k + triton.cdiv(k, cfg.block_k), dtype=torch.int32, device=a.device)
        _wna16_gemv_staged_kernel[(tiles, cfg.split_k)](
            a, a.view(torch.int64) if x_bf16 else a, q, w.scales, zeros, part, lock, out, xs, m,
            n, k, out.stride(0), cfg.k_iters, cfg.split_k, GROUP=w.group_size,
            HAS_ZP=w.zeros is not None, ASM=a.is_cuda, X_BF16=x_bf16, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, HAS_SPLIT=cfg.split_k > 1, GATED=gated,
            STAGE_ROWS=32 * cfg.num_warps, num_warps=cfg.num_warps, **pdl_args(a))
        return out.reshape(*lead, n)
    if kind.startswith("half2"):
        _wna16_gemv_half2_kernel[(tiles, cfg.split_k)](
            a, a.view(torch.int64) if x_bf16 else a, q,
            w.qweight_hi if w.qweight_hi is not None else q, w.scales, zeros, part, lock, out,
            m, n, k, out.stride(0), cfg.k_iters, cfg.split_k, GROUP=w.group_size,
            HAS_ZP=w.zeros is not None, ASM=a.is_cuda, X_BF16=x_bf16,
            EVEN_K=cfg.split_k * cfg.k_iters * cfg.block_k == k,
            PREFETCH=_HALF2_AHEAD[kind], BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            HAS_SPLIT=cfg.split_k > 1, STAGES=max(cfg.num_stages, 1) if kind == "half2_async"
            else 1, GATED=gated, X_AHEAD=kind == "half2_prefetch_x" and x_bf16, BITS=w.bits,
            PAIR_ROWS=kind == "half2_pair" and w.bits == 4 and cfg.block_k >= 16,
            num_warps=cfg.num_warps, **pdl_args(a))
        return out.reshape(*lead, n)
    if inplace:
        _wna16_gemv_inplace_kernel[(tiles, cfg.split_k)](
            a, a.view(torch.int64) if x_bf16 else a, q, w.scales, zeros, part, lock, out, m, n,
            k, a.stride(0), out.stride(0), cfg.k_iters, cfg.split_k, GROUP=w.group_size,
            BITS=w.bits, HAS_ZP=w.zeros is not None, ASM=a.is_cuda, X_BF16=x_bf16,
            EVEN_K=cfg.split_k * cfg.k_iters * cfg.block_k == k,
            PREFETCH=kind == "inplace_prefetch", BLOCK_M=bm,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_SPLIT=cfg.split_k > 1,
            num_warps=cfg.num_warps, **pdl_args(a))
        return out.reshape(*lead, n)
    if kind == "mma":
        gpu = a.is_cuda
        _wna16_gemv_mma_kernel[(tiles, cfg.split_k)](
            a, q, w.scales, zeros, part, lock, out, m, n, k, out.stride(0), cfg.k_iters,
            cfg.split_k, BITS=w.bits, HAS_ZP=w.zeros is not None, GROUP=w.group_size, ASM=gpu,
            DOT=dot_dtype(a), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            HAS_SPLIT=cfg.split_k > 1, EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0,
            num_warps=cfg.num_warps)
        return out.reshape(*lead, n)
    per_word = not (w.group_size % cfg.block_k == 0 or w.group_size == k)
    _wna16_gemv_fma_kernel[(tiles, cfg.split_k)](
        a, q, w.qweight_hi if w.qweight_hi is not None else q, w.scales, zeros, part, lock, out,
        m, n, k, a.stride(0), out.stride(0), cfg.k_iters, cfg.split_k,
        GROUP=w.group_size, BITS=w.bits, HAS_ZP=w.zeros is not None, PER_WORD=per_word,
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_SPLIT=cfg.split_k > 1,
        PREFETCH=kind == "fma_prefetch", num_warps=cfg.num_warps, **pdl_args(a))
    return out.reshape(*lead, n)


def _tc_launch(a: torch.Tensor, w: WNA16Layout, cfg: GemvConfig, gated: bool) -> torch.Tensor:
    from peregrine.kernels.wna16_gemv_tc import wna16_gemv_tc_kernel
    k, n = w.in_features, w.out_features
    v = cfg.block_n // (16 * cfg.num_warps)
    if v not in (1, 2, 4) or cfg.block_n != 16 * v * cfg.num_warps or cfg.block_k != 128:
        raise ValueError(f"wna16_gemv: the tc variant takes block_n = 16 * (1, 2 or 4) * "
                         f"num_warps and block_k 128; got {cfg.block_n}, {cfg.num_warps} warps, "
                         f"block_k {cfg.block_k}")
    if cfg.split_k * cfg.k_iters * 128 != k:
        raise ValueError(f"wna16_gemv: {cfg.split_k} splits x {cfg.k_iters} chunks of 128 are "
                         f"not the {k} inputs")
    tiles = triton.cdiv(n, cfg.block_n)
    out, part, lock = launch_buffers(a, n, tiles, cfg.split_k)
    m = a.shape[0]
    wna16_gemv_tc_kernel[(tiles, cfg.split_k)](
        a, w.qweight, w.qweight_hi if w.qweight_hi is not None else w.qweight, w.scales,
        w.zeros if w.zeros is not None else w.scales, part, lock, out,
        m, n, k, a.stride(0), cfg.split_k, cfg.k_iters, ROWS=1 if m == 1 else _TC_MAX_ROWS,
        GROUP=w.group_size, HAS_ZP=w.zeros is not None, BITS=w.bits,
        GATED=gated, V=v, WARPS=cfg.num_warps, HAS_SPLIT=cfg.split_k > 1,
        BF16=a.dtype == torch.bfloat16, AHEAD=_TC_AHEAD, X_AHEAD=_TC_X_AHEAD,
        num_warps=cfg.num_warps, **pdl_args(a))
    return out


def precompile_wna16_gemv(w: WNA16Layout, dtype: torch.dtype) -> None:
    """Compile this layer's GEMV for every row count it can serve (call at load time)."""
    if not (w.qweight.is_cuda and gemv_supported(w)):
        return
    for rows in sorted({block_m_for(m) for m in range(1, max_rows(w, dtype) + 1)}):
        wna16_gemv(torch.zeros(rows, w.in_features, dtype=dtype, device=w.qweight.device), w)
    gate_up = torch.zeros(1, 2 * w.in_features, dtype=dtype, device=w.qweight.device)
    if gated_supported(w, gate_up):  # a down projection's one-row form (SiLU-and-mul inside)
        wna16_gemv(gate_up, w, gated=True)
