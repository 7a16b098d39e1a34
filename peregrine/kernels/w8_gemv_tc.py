"""The small-batch 8-bit GEMV on tensor cores with every operand in registers (Gluon).

y (M, N) = x (M, K) @ (W (N, K) * scale)^T for 1-8 rows of 16-bit x and FP8 e4m3 weights stored
row-major with one scale per output channel or one per block of channels and 64, 128 or 256
inputs (the layouts the FP8 methods keep), or int8 weights with one scale per channel (the INT8
W8A8 method's). Each lane of a warp plays its part of the 16x8x16 fp16 MMA, as in
wna16_gemv_tc.py:

    C (16 channels, 8 columns) += A (16 channels, 16 inputs) . B (16 inputs, 8 columns)

- A (weights): lane 4g + t holds rows g and g + 8 at the MMA's inputs 2t, 2t+1, 2t+8, 2t+9. A
  step covers 64 inputs: lane t reads 16 bytes of each of its rows at inputs 16t..16t+15, and
  the step's MMA j takes word j of them (inputs 16t + 4j..16t + 4j + 3): its low two bytes
  become the pair (2t, 2t+1) and its high two the pair (2t+8, 2t+9), each by one
  cvt.rn.f16x2.e4m3x2 (exact: fp16 holds every e4m3 value); int8 bytes by an xor, a prmt under
  fp16's exponent of 1024 and a packed subtraction (exact too). The MMA's input order is thus a
  permutation of K (inputs 4j + 16t + {0, 1, 2, 3} over t), which the sum does not care about.
- B (x): column g is x's row g (up to 8 rows; at one row every column is that row), so each
  lane reads its row's 16 inputs at 16t..16t+15 (32 bytes) and MMA j takes the pairs (16t + 4j,
  +1) and (16t + 4j + 2, +3). bf16 x becomes fp16 scaled by 2^-8 (through float32: exact for
  |x| in [2^-6, 2^23], so no overflow where fp16 would overflow and a 2^-17 absolute error at
  most below), and the channel scale takes 2^8 back; fp16 x is read as it is.
- The fp32 sums are multiplied by the channel's scale once, at the end; with block scales each
  K block's sums are multiplied by its scale at the block's last step and added to a total.

A lane holds 2V channels (V M-tiles of 16), so a warp covers 16V channels and a program WARPS
warps side by side; each warp runs the program's whole K range (STEPS steps of 64 inputs) with
the weights and inputs AHEAD steps ahead of the MMAs (2 or 4). Split-K partials are combined
as in gemv.py (the last program of a column tile adds them in split order: deterministic).
CUDA only (sm_89+ for the e4m3 conversion, sm_80+ for int8), checked on the GPU against
x @ (W * scale)^T and its PTX and lane mapping on the CPU by an emulator
(tests/kernels/test_w8_gemv_tc_ptx.py).
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from peregrine.kernels._gluon import pdl_release, pdl_wait
from peregrine.kernels._utils import pdl_args
from peregrine.kernels.gemv import GemvConfig, _sms, launch_buffers, one_wave_split
from peregrine.kernels.wna16_gemv_tc import _ld_words, _push, _store_rows

# Programs of _WARPS warps of 16 * _V channels with _AHEAD steps of loads in flight (offline,
# sm_90: 157 registers a lane at 4 steps, so _RESIDENT_WARPS warps an SM), K split as much as
# one wave of programs allows (fp8_tc_config). Measured per call at Llama-3-8B's shapes, 1 and
# 8 rows: 4 steps ahead beat 2 by up to a quarter, the tile width and the warps a program
# moved them by a few percent, and a launch that spills into a second partial wave of programs
# (gate_up split 2: 1,792 programs for 1,584 places) lost a third against one wave.
_V = 2
_WARPS = 1
_AHEAD = 4
_RESIDENT_WARPS = 12
MAX_ROWS = 8
STEP = 64  # inputs a step
CHUNK = 4 * STEP  # the loop's unrolled unit: a program's K range is whole chunks


def _tile_asm(int8: bool = False) -> str:
    """PTX: one M-tile's four MMAs of a step: the words of rows g ($4..$7) and g + 8 ($8..$11),
    word j's bytes (0, 1) and (2, 3) as fp16 pairs, B pairs $12..$19 (two a word), onto the sums
    $20..$23 (C's registers); out $0..$3. FP8 bytes by cvt; int8 bytes q (int8=True) flipped to
    q + 128, placed under an fp16 exponent byte of 0x64 (1024 + q + 128) by prmt, 1152 taken off
    by one packed subtraction a pair (all exact)."""
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
    lines = ["{", ".reg .b16 glo, ghi, hlo, hhi;", ".reg .b32 a0, a1, a2, a3, ug, uh, e, k;"]
    if int8:  # the exponent bytes; 1152 in both fp16 halves
        lines += ["mov.b32 e, 0x64646464;", "mov.b32 k, 0x64806480;"]
    for j in range(4):
        if int8:
            lines += [f"lop3.b32 ug, ${4 + j}, 0x80808080, 0, 0x3C;",  # xor: q + 128 a byte
                      f"lop3.b32 uh, ${8 + j}, 0x80808080, 0, 0x3C;",
                      "prmt.b32 a0, ug, e, 0x4140;",  # bytes 0, 1 -> (2t, 2t+1)
                      "prmt.b32 a1, uh, e, 0x4140;",
                      "prmt.b32 a2, ug, e, 0x4342;",  # bytes 2, 3 -> (2t+8, 2t+9)
                      "prmt.b32 a3, uh, e, 0x4342;",
                      "sub.f16x2 a0, a0, k;", "sub.f16x2 a1, a1, k;",
                      "sub.f16x2 a2, a2, k;", "sub.f16x2 a3, a3, k;"]
        else:
            lines += [f"mov.b32 {{glo, ghi}}, ${4 + j};", f"mov.b32 {{hlo, hhi}}, ${8 + j};",
                      "cvt.rn.f16x2.e4m3x2 a0, glo;", "cvt.rn.f16x2.e4m3x2 a1, hlo;",
                      "cvt.rn.f16x2.e4m3x2 a2, ghi;", "cvt.rn.f16x2.e4m3x2 a3, hhi;"]
        c = "{$20, $21, $22, $23}" if j == 0 else "{$0, $1, $2, $3}"
        lines.append(f"{mma} {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, "
                     f"{{${12 + 2 * j}, ${13 + 2 * j}}}, {c};")
    lines.append("}")
    return "\n".join(lines)


def _x_asm() -> str:
    """PTX: four words of bf16 pairs ($4..$7) as fp16 pairs scaled by 2^-8 (through float32,
    rounded to nearest); out $0..$3."""
    lines = ["{", ".reg .b32 lo, hi;"]
    for j in range(4):
        lines += [f"shl.b32 lo, ${4 + j}, 16;", f"and.b32 hi, ${4 + j}, 0xFFFF0000;",
                  "mul.f32 lo, lo, 0f3B800000;", "mul.f32 hi, hi, 0f3B800000;",
                  f"cvt.rn.f16x2.f32 ${j}, hi, lo;"]
    lines.append("}")
    return "\n".join(lines)


_TILE = gl.constexpr(_tile_asm())
_TILE_I8 = gl.constexpr(_tile_asm(int8=True))
_X_BF16 = gl.constexpr(_x_asm())


@gluon.jit
def _ld_x(xa, BF16: gl.constexpr):
    """The lane's 16 inputs of a step (32 bytes at xa) as 8 fp16 pairs (bf16: scaled by 2^-8)."""
    a = _ld_words(xa, 4, False)
    b = _ld_words(xa + 16, 4, False)
    if BF16:
        p = gl.inline_asm_elementwise(_X_BF16, "=r,=r,=r,=r,r,r,r,r", [a[0], a[1], a[2], a[3]],
                                      dtype=(gl.int32,) * 4, is_pure=True, pack=1)
        q = gl.inline_asm_elementwise(_X_BF16, "=r,=r,=r,=r,r,r,r,r", [b[0], b[1], b[2], b[3]],
                                      dtype=(gl.int32,) * 4, is_pure=True, pack=1)
        r = (p[0], p[1], p[2], p[3], q[0], q[1], q[2], q[3])
    else:
        r = (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3])
    return r


@gluon.jit
def _ld_step(wa, row_step, V: gl.constexpr):
    """A step's words of the lane's 2V channels (16 bytes each, channel c at wa + c * row_step):
    a tuple of 2V tuples of 4 (rows g of M-tiles 0..V-1, then rows g + 8)."""
    c0 = _ld_words(wa, 4, True)
    c1 = _ld_words(wa + row_step, 4, True)
    if V == 1:
        r = (c0, c1)
    else:
        c2 = _ld_words(wa + 2 * row_step, 4, True)
        c3 = _ld_words(wa + 3 * row_step, 4, True)
        if V == 2:
            r = (c0, c1, c2, c3)
        else:
            c4 = _ld_words(wa + 4 * row_step, 4, True)
            c5 = _ld_words(wa + 5 * row_step, 4, True)
            c6 = _ld_words(wa + 6 * row_step, 4, True)
            c7 = _ld_words(wa + 7 * row_step, 4, True)
            r = (c0, c1, c2, c3, c4, c5, c6, c7)
    return r


@gluon.jit
def _tile(wg, wh, b, c, INT8: gl.constexpr):
    """An M-tile's four MMAs of a step: C's registers c onto the words of rows g (wg) and g + 8
    (wh) and the step's 8 B pairs b."""
    if INT8:
        r = gl.inline_asm_elementwise(
            _TILE_I8, "=f,=f,=f,=f," + "r," * 16 + "f,f,f,f",
            [wg[0], wg[1], wg[2], wg[3], wh[0], wh[1], wh[2], wh[3],
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], c[0], c[1], c[2], c[3]],
            dtype=(gl.float32,) * 4, is_pure=True, pack=1)
    else:
        r = gl.inline_asm_elementwise(
            _TILE, "=f,=f,=f,=f," + "r," * 16 + "f,f,f,f",
            [wg[0], wg[1], wg[2], wg[3], wh[0], wh[1], wh[2], wh[3],
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], c[0], c[1], c[2], c[3]],
            dtype=(gl.float32,) * 4, is_pure=True, pack=1)
    return r[0], r[1], r[2], r[3]


@gluon.jit
def _step(acc, w, b, V: gl.constexpr, INT8: gl.constexpr):
    """A step's MMAs: acc (4 M-tiles' C registers; V used) onto the words w (_ld_step: the lane's
    channel i holds tile i's row g for i < V, tile i - V's row g + 8 above) and B pairs b."""
    a0 = _tile(w[0], w[V], b, acc[0], INT8)
    a1 = acc[1]
    a2 = acc[2]
    a3 = acc[3]
    if V >= 2:
        a1 = _tile(w[1], w[V + 1], b, acc[1], INT8)
    if V == 4:
        a2 = _tile(w[2], w[6], b, acc[2], INT8)
        a3 = _tile(w[3], w[7], b, acc[3], INT8)
    return a0, a1, a2, a3


@gluon.jit
def _ld_item(wa, xa, i, w_step, row_step, V: gl.constexpr, BF16: gl.constexpr,
             X: gl.constexpr):
    """Step i's words (X False) or B pairs (X True)."""
    if X:
        r = _ld_x(xa + i * 128, BF16)
    else:
        r = _ld_step(wa + i * w_step, row_step, V)
    return r


@gluon.jit
def _ld_queue(wa, w_step, xa, last, row_step, N: gl.constexpr, V: gl.constexpr,
              BF16: gl.constexpr, X: gl.constexpr):
    """Steps 0..N-1 (2 or 4) of the words (X False) or B pairs (X True); past the last step
    the last again."""
    q0 = _ld_item(wa, xa, 0, w_step, row_step, V, BF16, X)
    q1 = _ld_item(wa, xa, gl.minimum(1, last), w_step, row_step, V, BF16, X)
    if N == 2:
        r = (q0, q1)
    else:
        q2 = _ld_item(wa, xa, gl.minimum(2, last), w_step, row_step, V, BF16, X)
        q3 = _ld_item(wa, xa, gl.minimum(3, last), w_step, row_step, V, BF16, X)
        r = (q0, q1, q2, q3)
    return r


@gluon.jit
def _scaled(y, acc, s, R: gl.constexpr, V: gl.constexpr, UNSCALE: gl.constexpr):
    """The lane's 8 sums of x's row 2t + R (C's register R of rows g, 2 + R of rows g + 8) times
    their channels' scales s (2V floats: rows g of tiles 0..V-1, then rows g + 8)."""
    y0 = acc[0][R] * (s[0] * UNSCALE)
    y4 = acc[0][2 + R] * (s[V] * UNSCALE)
    y1, y2, y3, y5, y6, y7 = y[1], y[2], y[3], y[5], y[6], y[7]
    if V >= 2:
        y1 = acc[1][R] * (s[1] * UNSCALE)
        y5 = acc[1][2 + R] * (s[V + 1] * UNSCALE)
    if V == 4:
        y2 = acc[2][R] * (s[2] * UNSCALE)
        y3 = acc[3][R] * (s[3] * UNSCALE)
        y6 = acc[2][2 + R] * (s[6] * UNSCALE)
        y7 = acc[3][2 + R] * (s[7] * UNSCALE)
    return y0, y1, y2, y3, y4, y5, y6, y7


@gluon.jit
def _ld_scales(s_ptr, n_ld, V: gl.constexpr):
    """The lane's 2V float32 channel scales (channel n_ld + i)."""
    s0 = gl.load(s_ptr + n_ld)
    s1 = gl.load(s_ptr + (n_ld + 1))
    if V == 1:
        r = (s0, s1)
    else:
        s2 = gl.load(s_ptr + (n_ld + 2))
        s3 = gl.load(s_ptr + (n_ld + 3))
        if V == 2:
            r = (s0, s1, s2, s3)
        else:
            s4 = gl.load(s_ptr + (n_ld + 4))
            s5 = gl.load(s_ptr + (n_ld + 5))
            s6 = gl.load(s_ptr + (n_ld + 6))
            s7 = gl.load(s_ptr + (n_ld + 7))
            r = (s0, s1, s2, s3, s4, s5, s6, s7)
    return r


@gluon.jit
def _fold4(tot, acc, sc):
    return tot[0] + acc[0] * sc, tot[1] + acc[1] * sc, tot[2] + acc[2] * sc, tot[3] + acc[3] * sc


@gluon.jit
def _fold(tot, acc, sc, V: gl.constexpr):
    """tot + acc * sc over the V M-tiles in use (a K block's sums times its scale)."""
    t0 = _fold4(tot[0], acc[0], sc)
    t1 = tot[1]
    t2 = tot[2]
    t3 = tot[3]
    if V >= 2:
        t1 = _fold4(tot[1], acc[1], sc)
    if V == 4:
        t2 = _fold4(tot[2], acc[2], sc)
        t3 = _fold4(tot[3], acc[3], sc)
    return t0, t1, t2, t3


@gluon.jit
def _ones(one, V: gl.constexpr):
    """2V channel scales of 1 (block scales are applied in the K loop)."""
    if V == 1:
        r = (one, one)
    elif V == 2:
        r = (one, one, one, one)
    else:
        r = (one, one, one, one, one, one, one, one)
    return r


@gluon.jit(do_not_specialize=["M", "stride_am", "SPLIT_K", "STEPS", "SBN", "SKB"])
def w8_gemv_tc_kernel(
    a_ptr, w_ptr, s_ptr, part_ptr, lock_ptr, c_ptr,
    M, N, K, stride_am, SPLIT_K, STEPS, SBN, SKB,
    V: gl.constexpr, WARPS: gl.constexpr, HAS_SPLIT: gl.constexpr, BF16: gl.constexpr,
    PDL: gl.constexpr, AHEAD: gl.constexpr = 4, ROWS: gl.constexpr = 1,
    BLOCK_KS: gl.constexpr = 0, INT8: gl.constexpr = False,
):
    """y (M, N) of M <= ROWS <= 8 rows x (M, K), rows stride_am apart, and FP8 (INT8: int8)
    weights (N, K) contiguous with float32 scales: (N,) one a channel (BLOCK_KS 0), or
    (N / SBN, SKB) one a block of SBN channels (a multiple of the program's) by BLOCK_KS steps
    (1, 2 or 4: 64, 128 or 256 inputs), row-major; the output and the partials (split, M, N)
    contiguous.
    Program (tile, split) covers WARPS * 16V channels and the STEPS steps (a multiple of 4) of
    64 inputs from split * STEPS * 64; N is a multiple of 2V (a lane's channels are all there
    or all past N). Lane 4g + t's channel i (i < 2V) is n_lane + i: M-tile i's row g for i < V,
    tile i - V's row g + 8 above (so _store_rows of wna16_gemv_tc.py writes its sums)."""
    T: gl.constexpr = 32 * WARPS
    L: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    idx = gl.arange(0, T, layout=L)
    lane = idx % 32
    g = lane // 4
    t = lane % 4
    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    n_lane = pid_n * (WARPS * 16 * V) + (idx // 32) * (16 * V) + g * (2 * V)
    n_ok = n_lane < N
    n_ld = gl.minimum(n_lane, N - 2 * V)  # a lane past N reads the last channels (dropped)
    k0 = split * (STEPS * 64) + 16 * t  # the lane's first input (steps of 64)
    row_step = K.to(gl.int64)  # bytes between channels
    wa = w_ptr.to(gl.int64) + n_ld.to(gl.int64) * row_step + k0
    w_step = 64
    xa = a_ptr.to(gl.int64) + k0.to(gl.int64) * 2  # ROWS == 1: every column is row 0
    if ROWS > 1:  # B's column g: x's row g, the last row again past M
        xa += gl.minimum(g, M - 1).to(gl.int64) * stride_am * 2
    last = STEPS - 1

    # the first AHEAD steps' weights are issued before the wait in the source (ptxas may
    # place the wait above these read-only loads)
    w_q = _ld_queue(wa, w_step, xa, last, row_step, AHEAD, V, BF16, False)
    zero = gl.zeros([T], gl.float32, layout=L)
    if BLOCK_KS > 0:  # the lane's block row of scales, from the program's first K block
        s_row = s_ptr + (n_ld // SBN).to(gl.int64) * SKB + split * (STEPS // BLOCK_KS)
        s = _ones(zero + 1.0, V)
    else:
        s = _ld_scales(s_ptr, n_ld, V)
    pdl_wait(PDL)
    x_q = _ld_queue(wa, w_step, xa, last, row_step, AHEAD, V, BF16, True)
    c4 = (zero, zero, zero, zero)
    acc = (c4, c4, c4, c4)
    tot = acc
    for c in range(STEPS // 4):
        for j in gl.static_range(4):  # unrolled: the queues rotate without register moves
            if BLOCK_KS > 0:
                if j % BLOCK_KS == 0:  # a K block starts: its scale, used at its last step
                    sc = gl.load(s_row + (c * 4 + j) // BLOCK_KS)
            # NOTE: AHEAD steps' words and B pairs in registers: the oldest is computed, the
            # step AHEAD on is loaded (past the last one the last again, from L2).
            nxt = gl.minimum(c * 4 + j + AHEAD, last)
            w_c = w_q[0]
            x_c = x_q[0]
            w_q = _push(w_q, _ld_item(wa, xa, nxt, w_step, row_step, V, BF16, False), AHEAD)
            x_q = _push(x_q, _ld_item(wa, xa, nxt, w_step, row_step, V, BF16, True), AHEAD)
            acc = _step(acc, w_c, x_c, V, INT8)
            if BLOCK_KS > 0:
                if j % BLOCK_KS == BLOCK_KS - 1:  # the block's sums, scaled, onto the total
                    tot = _fold(tot, acc, sc, V)
                    acc = (c4, c4, c4, c4)
    if BLOCK_KS > 0:
        acc = tot
    pdl_release(PDL)
    UNSCALE: gl.constexpr = 256.0 if BF16 else 1.0
    y = _scaled((zero, zero, zero, zero, zero, zero, zero, zero), acc, s, 0, V, UNSCALE)
    # (rows 2t)
    y_odd = y
    if ROWS > 1:  # rows 2t + 1
        y_odd = _scaled(y, acc, s, 1, V, UNSCALE)
    _store_rows(y, y_odd, n_lane, n_ok, t, M, N, split, pid_n, part_ptr, lock_ptr, c_ptr, SPLIT_K,
                V, WARPS, ROWS, HAS_SPLIT)


@functools.lru_cache(maxsize=8)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _block_ok(n: int, k: int, scale: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether scale is what the kernel reads for this block shape: (N,) or (1, N) float32 per
    channel without a block; with one, (N / bn, K / bk) float32 row-major, bk 64, 128 or 256
    inputs, bn a multiple of a program's channels."""
    if block is None:
        return scale.numel() == n
    bn, bk = block
    return (bk in (64, 128, 256) and bn % (16 * _V * _WARPS) == 0
            and scale.dtype == torch.float32 and scale.is_contiguous()
            and tuple(scale.shape) == (triton.cdiv(n, bn), k // bk))


def fp8_tc_weight_ok(weight: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int] | None = None) -> bool:
    """Whether the kernel reads this weight: FP8 e4m3 (sm_89 or later) or int8 (sm_80 or later)
    (N, K) contiguous and 16-byte aligned on a CUDA GPU, K a multiple of 256 and N of 2 * _V,
    one scale per channel or (FP8) per block (_block_ok)."""
    if weight.dim() != 2 or not weight.is_cuda:
        return False
    n, k = weight.shape
    fp8 = weight.dtype == torch.float8_e4m3fn
    return ((fp8 or (weight.dtype == torch.int8 and block is None)) and weight.is_contiguous()
            and weight.data_ptr() % 16 == 0 and k % CHUNK == 0 and n % (2 * _V) == 0
            and _block_ok(n, k, scale, block)
            and _capability(weight.device.index if weight.device.index is not None
                            else torch.cuda.current_device()) >= ((8, 9) if fp8 else (8, 0)))


def fp8_tc_supported(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int] | None = None) -> bool:
    """Whether the kernel serves x (M, K) and this weight: at most MAX_ROWS rows of 16-bit x
    (16-byte aligned) on the weight's device, and fp8_tc_weight_ok."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == weight.shape[-1]
            and x.stride(1) == 1 and (x.shape[0] == 1 or x.stride(0) % 8 == 0)
            and x.data_ptr() % 16 == 0 and x.dtype in (torch.bfloat16, torch.float16)
            and x.device == weight.device and fp8_tc_weight_ok(weight, scale, block))


def fp8_tc_config(n: int, k: int, device: torch.device) -> GemvConfig:
    """The launch: block_n = the program's channels (_WARPS warps of 16 * _V), block_k one step
    (64 inputs), the K split the largest divisor of the chunks of 256 inputs that keeps every
    program in one wave (k_iters: steps a program)."""
    block_n = 16 * _V * _WARPS
    tiles = triton.cdiv(n, block_n)
    chunks = k // CHUNK
    room = max(1, _RESIDENT_WARPS // _WARPS * _sms(device))  # programs resident at once
    split = one_wave_split(tiles, chunks, room)
    return GemvConfig(block_n, STEP, split, chunks // split * 4, _WARPS)


def w8_gemv_tc(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               config: GemvConfig | None = None,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """y (M, N) = x (M, K) @ (weight (N, K) * scale)^T in x's dtype on tensor cores, scale one
    a channel or, with block (bn, bk), one a block (N / bn, K / bk), for the inputs
    fp8_tc_supported accepts (else a ValueError naming them)."""
    if not fp8_tc_supported(x, weight, scale, block):
        raise ValueError(f"w8_gemv_tc: takes 1-{MAX_ROWS} rows of 16-bit x and FP8 e4m3 or int8 "
                         f"weights (N, K) contiguous, K a multiple of {CHUNK}, N of {2 * _V}, "
                         f"float32 scales one a channel or (FP8) one a block of a multiple of "
                         f"{16 * _V * _WARPS} channels by 64, 128 or 256 inputs, on a CUDA GPU "
                         f"(sm_89+ for FP8, sm_80+ for int8); got x {tuple(x.shape)} {x.dtype} on {x.device}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}, scales {tuple(scale.shape)} "
                         f"{scale.dtype}, block {block}")
    n, k = weight.shape
    m = x.shape[0]
    cfg = config or fp8_tc_config(n, k, x.device)
    if (cfg.block_k != STEP or cfg.k_iters % 4 or cfg.split_k * cfg.k_iters * STEP != k
            or _AHEAD not in (2, 4)):
        raise ValueError(f"w8_gemv_tc: {cfg.split_k} splits x {cfg.k_iters} steps of {STEP} "
                         f"inputs (a multiple of 4 steps each) do not make the {k} inputs")
    v = cfg.block_n // (16 * cfg.num_warps)
    if v not in (1, 2, 4) or v * 16 * cfg.num_warps != cfg.block_n or n % (2 * v):
        raise ValueError(f"w8_gemv_tc: block_n {cfg.block_n} is not 16 * V * warps with V in "
                         f"1, 2, 4 dividing N / 2 ({n})")
    if block is not None and block[0] % cfg.block_n:
        raise ValueError(f"w8_gemv_tc: block_n {cfg.block_n} does not divide the scale blocks' "
                         f"{block[0]} channels")
    tiles = triton.cdiv(n, cfg.block_n)
    out, part, lock = launch_buffers(x, n, tiles, cfg.split_k)
    if block is None:
        s, sbn, skb, block_ks = scale.reshape(n).float().contiguous(), 1, 1, 0
    else:
        s, sbn, skb, block_ks = scale, block[0], scale.shape[1], block[1] // STEP
    w8_gemv_tc_kernel[(tiles, cfg.split_k)](
        x, weight, s, part, lock, out, m, n, k, x.stride(0), cfg.split_k, cfg.k_iters, sbn, skb,
        V=v, WARPS=cfg.num_warps, HAS_SPLIT=cfg.split_k > 1, BF16=x.dtype == torch.bfloat16,
        AHEAD=_AHEAD, ROWS=1 if m == 1 else MAX_ROWS, BLOCK_KS=block_ks,
        INT8=weight.dtype == torch.int8, num_warps=cfg.num_warps, **pdl_args(x))
    return out


def precompile_w8_gemv_tc(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                          block: tuple[int, int] | None = None) -> None:
    """Compile the kernel for this weight at one row and at several (call at load time)."""
    if dtype not in (torch.bfloat16, torch.float16) or not fp8_tc_weight_ok(weight, scale, block):
        return
    for rows in (1, 2):  # ROWS 1 and MAX_ROWS
        w8_gemv_tc(torch.zeros(rows, weight.shape[1], dtype=dtype, device=weight.device), weight,
                   scale, block=block)
