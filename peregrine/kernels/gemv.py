"""Small-batch GEMVs: y (M, N) = x (M, K) @ dequant(W)^T for M <= GEMV_MAX_M rows, where a
decode step is bound by reading the weight once. The weight-only int layout has its own kernel
(wna16_gemv.py); this module holds what both share, and the 8-bit one: FP8 e4m3 or int8 weights
(N, K) with per-channel or (bn x bk) block scales, multiplied by 16/32-bit activations as they are
(weight-only math: no activation quantization at these sizes).

Every kernel here multiplies in float32 registers (no tl.dot, which would pad M to 16) and splits
K over programs so a few rows still spread the read over every SM. Split-K is deterministic: each
program writes its float32 partial sums, then takes a ticket on its column tile's counter; the
last of the SPLIT_K programs adds the partials in split order (whatever order they arrived in),
writes the output in x's dtype and resets the counter. One launch, and the same bits every run.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from peregrine.kernels._utils import next_pow2, num_sms, pdl_args, pdl_release, pdl_wait
from peregrine.kernels.activation import silu_mul

# The cut-offs, measured on an H200 at Llama-3-8B's shapes (benchmarks/gemv_bench.py): a linear
# with at most this many rows uses a GEMV on CUDA, more use the GEMMs. The int layout's GEMV beats
# its GEMM up to 4 rows (e.g. gate_up 76 against 131 us at 4 rows, 200 against 131 at 8); the
# 8-bit GEMV beats quantize + _scaled_mm / _int_mm up to 2 rows (36 against 52 us at 2, 87
# against 51 at 4).
GEMV_MAX_M = 4
W8_GEMV_MAX_M = 2
# The most rows the kernels take (compiled as 1, 2, 4 or 8).
GEMV_MAX_ROWS = 8
# Programs launched per SM (at least): enough column tiles x K splits to hide memory latency.
_WAVES = 4
_MAX_SPLIT = 32
MAX_SPLIT = tl.constexpr(_MAX_SPLIT)  # the most splits finish_split_k sums squares over
# Per-device split-K tickets (one int32 per column tile), zero between launches.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_COUNTER_SLOTS = 1 << 14


def use_gemv(x: torch.Tensor, max_m: int = GEMV_MAX_M) -> bool:
    """Whether x (..., K) is a small batch for the GEMVs (CUDA, 1..max_m rows)."""
    return x.is_cuda and 0 < x.numel() // max(x.shape[-1], 1) <= max_m


def block_m_for(m: int) -> int:
    """The compiled row count that serves m rows (a power of two up to GEMV_MAX_ROWS)."""
    if not 0 < m <= GEMV_MAX_ROWS:
        raise ValueError(f"the GEMV takes 1 to {GEMV_MAX_ROWS} rows, got {m}")
    return next_pow2(m)


def counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K tickets of `device` (allocated once, before any graph capture uses them)."""
    if tiles > _COUNTER_SLOTS:
        raise ValueError(f"GEMV: {tiles} column tiles exceed the {_COUNTER_SLOTS} split-K slots")
    buf = _COUNTERS.get(device)
    if buf is None:
        buf = _COUNTERS[device] = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


def _sms(device: torch.device) -> int:
    """The SMs the launch rules count on: the GPU's, or 8 on the CPU (the interpreter)."""
    return num_sms(device) if device.type == "cuda" else 8


def choose_split(tiles: int, k_blocks: int, device: torch.device,
                 waves: float = _WAVES, max_k_iters: int | None = None) -> tuple[int, int]:
    """(split_k, k_iters): the fewest power-of-two K splits that launch `waves` programs per
    SM and leave each at most `max_k_iters` K blocks, then trimmed so that no split is left
    without a K block."""
    target = waves * _sms(device)
    split = 1
    while ((tiles * split < target or (max_k_iters and triton.cdiv(k_blocks, split)
                                         > max_k_iters))
           and split * 2 <= min(_MAX_SPLIT, k_blocks)):
        split *= 2
    k_iters = triton.cdiv(k_blocks, split)
    return triton.cdiv(k_blocks, k_iters), k_iters


def one_wave_split(tiles: int, chunks: int, room: int, least: int = 1) -> int:
    """The largest divisor of `chunks` (K pieces) whose `tiles` x split programs fit in `room`
    programs resident at once, and never below `least` (a divisor itself)."""
    return max(d for d in range(1, chunks + 1)
               if chunks % d == 0 and (d <= least or tiles * d <= room))


def launch_buffers(x2: torch.Tensor, n: int, tiles: int, split: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (M, N) in x's dtype, float32 partials (split, M, N), tickets) for one launch."""
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    part = torch.empty((split, m, n) if split > 1 else (1,), dtype=torch.float32,
                       device=x2.device)
    return out, part, counters(x2.device, tiles)


@triton.jit
def add_residual(y, res_ptr, m, stride_rm, offs_n, mask, out_dtype: tl.constexpr):
    """Row m's output y (BLOCK_N,) rounded to out_dtype, plus the residual row, rounded again:
    the bits of the separate GEMV, then the residual add of the norm kernel after it."""
    r = tl.load(res_ptr + m * stride_rm + offs_n, mask=mask, other=0.0)
    return (y.to(out_dtype).to(tl.float32) + r.to(tl.float32)).to(out_dtype)


@triton.jit
def store_partial(part_ptr, c_ptr, val, m, M, N, split, offs_n, n_mask, stride_cm,
                  HAS_SPLIT: tl.constexpr, res_ptr=None, stride_rm=0,
                  HAS_RES: tl.constexpr = False):
    """Row m's (BLOCK_N,) float32 sums of this program's K range: the output itself without a
    split (HAS_RES: plus row m of the residual at res_ptr), else this split's partial."""
    if not HAS_SPLIT:
        mask = n_mask & ((offs_n * 0 + m) < M)
        if HAS_RES:
            y = add_residual(val, res_ptr, m, stride_rm, offs_n, mask, c_ptr.dtype.element_ty)
        else:
            y = val.to(c_ptr.dtype.element_ty)
        tl.store(c_ptr + m * stride_cm + offs_n, y, mask=mask)
    else:
        row = (split * M + m).to(tl.int64)
        tl.store(part_ptr + row * N + offs_n, val, mask=n_mask & ((offs_n * 0 + m) < M))


@triton.jit
def store_silu_pairs(c_ptr, y, pid_n, half_n, BLOCK_N: tl.constexpr):
    """One row's (BLOCK_N,) float32 sums of gate/up channel pairs, side by side (gate c, up c,
    gate c + 1, ...): silu(gate) * up for the tile's BLOCK_N / 2 channels at c_ptr, each sum
    rounded to c's dtype first as the GEMV's output is, then the product as the activation
    kernel rounds it (the bits of the GEMV, then the activation kernel)."""
    dt = c_ptr.dtype.element_ty
    gate, up = tl.split(tl.reshape(y.to(dt).to(tl.float32), (BLOCK_N // 2, 2)))
    offs = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)  # (BN / 2,)
    tl.store(c_ptr + offs, silu_mul(gate, up).to(dt), mask=offs < half_n)


@triton.jit
def row_accumulators(ROWS: tl.constexpr, COLS: tl.constexpr):
    """Eight zeroed float32 (ROWS, COLS) accumulators, one per row of x a GEMV can take (those
    past its BLOCK_M are never touched and cost nothing)."""
    z = tl.zeros((ROWS, COLS), dtype=tl.float32)
    return z, z, z, z, z, z, z, z


@triton.jit
def store_row_sums(part_ptr, lock_ptr, c_ptr, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                   M, N, pid_n, split, offs_n, n_mask, stride_cm, SPLIT_K,
                   HAS_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program's epilogue for (rows, columns)-shaped per-row accumulators: each row's column
    sums (over axis 0) stored as the output or this split's partial, then the split-K finish."""
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


@triton.jit
def _partial(part_ptr, s, m, M, N, offs_n, n_mask, SPLIT_K):
    """Split s's partial sums of row m (BLOCK_N,), read from L2; zeros for s >= SPLIT_K."""
    ok = n_mask & ((offs_n * 0 + s) < SPLIT_K)
    return tl.load(part_ptr + (s * M + m).to(tl.int64) * N + offs_n, mask=ok, other=0.0,
                   cache_modifier=".cg")


@triton.jit
def finish_split_k(part_ptr, lock_ptr, c_ptr, M, N, pid_n, offs_n, n_mask, stride_cm,
                   SPLIT_K, HAS_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, res_ptr=None, stride_rm=0,
                   HAS_RES: tl.constexpr = False, ss_ptr=None, eps=0.0, K=1,
                   NORMED: tl.constexpr = False):
    """The last program of a column tile adds its SPLIT_K partials in split order (HAS_RES:
    then the residual row, as store_partial does; NORMED: one row, scaled by 1 / rms of the
    row from the splits' sums of squares at ss_ptr + pid_n * SPLIT_K, _MAX_SPLIT at most)."""
    if HAS_SPLIT:
        # NOTE: every thread's partial stores are issued before the ticket (barrier), and the
        # ticket is a gpu-scope acq_rel atomic, so the last program sees all partials; it reads
        # them from L2 (.cg), never a stale L1 line.
        tl.debug_barrier()
        ticket = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            for m in tl.static_range(BLOCK_M):
                if m < M:
                    # NOTE: eight partials' loads are issued before any is added, so their
                    # L2 round trips overlap; the adds stay in split order (a split past SPLIT_K
                    # reads 0.0, which leaves the sum as it is), so the result is the one-by-one
                    # loop's (up to the sign of a zero sum).
                    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                    for s0 in range(0, SPLIT_K, 8):
                        p0 = _partial(part_ptr, s0, m, M, N, offs_n, n_mask, SPLIT_K)
                        p1 = _partial(part_ptr, s0 + 1, m, M, N, offs_n, n_mask, SPLIT_K)
                        p2 = _partial(part_ptr, s0 + 2, m, M, N, offs_n, n_mask, SPLIT_K)
                        p3 = _partial(part_ptr, s0 + 3, m, M, N, offs_n, n_mask, SPLIT_K)
                        p4 = _partial(part_ptr, s0 + 4, m, M, N, offs_n, n_mask, SPLIT_K)
                        p5 = _partial(part_ptr, s0 + 5, m, M, N, offs_n, n_mask, SPLIT_K)
                        p6 = _partial(part_ptr, s0 + 6, m, M, N, offs_n, n_mask, SPLIT_K)
                        p7 = _partial(part_ptr, s0 + 7, m, M, N, offs_n, n_mask, SPLIT_K)
                        total += p0
                        total += p1
                        total += p2
                        total += p3
                        total += p4
                        total += p5
                        total += p6
                        total += p7
                    if NORMED:
                        offs_s = tl.arange(0, MAX_SPLIT)
                        ssq = tl.load(ss_ptr + pid_n * SPLIT_K + offs_s, mask=offs_s < SPLIT_K,
                                      other=0.0, cache_modifier=".cg")
                        total = total * tl.rsqrt(tl.sum(ssq, axis=0) / K + eps)
                    if HAS_RES:
                        y = add_residual(total, res_ptr, m, stride_rm, offs_n, n_mask,
                                         c_ptr.dtype.element_ty)
                    else:
                        y = total.to(c_ptr.dtype.element_ty)
                    tl.store(c_ptr + m * stride_cm + offs_n, y, mask=n_mask)
            tl.atomic_xchg(lock_ptr + pid_n, 0)


@triton.jit
def _w8_block(w_rows, s_ptr, offs_n, n_mask, k0, K, k_end, scale_cols, BLOCK_SCALE: tl.constexpr,
              BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K block at k0's weights (BN, BK) as stored and its block scales (BN,) (ones with
    per-channel scales); nothing is read from K or k_end (this program's end) on."""
    offs_k = k0 + tl.arange(0, BLOCK_K)  # (BK,)
    k_mask = (offs_k < K) & (offs_k < k_end)
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    if BLOCK_SCALE:
        # NOTE: BK_SCALE is a multiple of BLOCK_K: one scale per weight row in this block.
        s = tl.load(s_ptr + (offs_n // BN_SCALE) * scale_cols + tl.minimum(k0, K - 1) // BK_SCALE,
                    mask=n_mask, other=0.0)  # (BN,)
    else:
        s = tl.full((offs_n.shape[0],), 1.0, tl.float32)
    return w, s


@triton.jit
def _row_dot(w, a_ptr, m, M, stride_am, offs_k, k_mask, K, FORM: tl.constexpr,
             GATED: tl.constexpr):
    """sum_k w[n, k] * x[m, k] over this K block (zeros past row M) as float32: FORM 0 (BLOCK_N,),
    the whole block reduced (across threads) every block; FORM 1 (BLOCK_N, BLOCK_K / 16), each
    thread's sums of its own 16 adjacent k (the 16 bytes it loads), so threads exchange nothing
    until the K loop is done. GATED: row m is a gate-and-up row h (2K,) and x = silu(h[:K]) *
    h[K:], rounded to h's dtype as the activation kernel's output is."""
    row_ok = (offs_k * 0 + m) < M  # (BK,): a tensor mask, also under the interpreter
    row = a_ptr + m * stride_am
    if GATED:
        g = tl.load(row + offs_k, mask=k_mask & row_ok, other=0.0)  # (BK,)
        u = tl.load(row + K + offs_k, mask=k_mask & row_ok, other=0.0)
        x = silu_mul(g.to(tl.float32), u.to(tl.float32)).to(a_ptr.dtype.element_ty)
    else:
        x = tl.load(row + offs_k, mask=k_mask & row_ok, other=0.0)  # (BK,)
    p = w * x.to(tl.float32)[None, :]  # (BN, BK)
    if FORM == 0:
        sums = tl.sum(p, axis=1)
    else:
        sums = tl.sum(tl.reshape(p, (p.shape[0], p.shape[1] // 16, 16)), axis=2)
    return sums


@triton.jit
def _row_dot_normed(w, a_ptr, nw_ptr, offs_k, k_mask, FORM: tl.constexpr):
    """_row_dot of row 0 for x = h * nw, h the row at a_ptr (the residual stream) and nw the
    RMSNorm weight, both read here, in float32 and not rounded; also h^2 (BLOCK_K,), whose sum
    over the whole row gives the norm's 1 / rms that the caller multiplies in at the end."""
    h = tl.load(a_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)  # (BK,)
    nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)  # (BK,)
    p = w * (h * nw)[None, :]  # (BN, BK)
    if FORM == 0:
        sums = tl.sum(p, axis=1)
    else:
        sums = tl.sum(tl.reshape(p, (p.shape[0], p.shape[1] // 16, 16)), axis=2)
    return sums, h * h


@triton.jit
def _w8_acc(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FORM: tl.constexpr):
    """A zero accumulator of _row_dot's shape for FORM."""
    if FORM == 0:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
    return acc


@triton.jit
def _w8_sums(acc, FORM: tl.constexpr):
    """The (BLOCK_N,) sums of a _w8_acc accumulator."""
    if FORM != 0:
        acc = tl.sum(acc, axis=1)
    return acc


# Four int8 weights (one 32-bit register, the first lowest) to float32, exactly: an xor with
# 0x80 makes each byte q + 128, a prmt puts it under float32's exponent byte 0x4B (the float
# 2^23 + q + 128), one subtraction of 2^23 + 128 leaves q. Nine instructions for four values,
# where a conversion instruction each runs at a quarter of the FMA rate.
ASM_I8_F32 = tl.constexpr("""{
.reg .b32 t;
xor.b32 t, $4, 0x80808080;
prmt.b32 $0, t, 0x4B000000, 0x7540;
prmt.b32 $1, t, 0x4B000000, 0x7541;
prmt.b32 $2, t, 0x4B000000, 0x7542;
prmt.b32 $3, t, 0x4B000000, 0x7543;
sub.f32 $0, $0, 0f4B000080;
sub.f32 $1, $1, 0f4B000080;
sub.f32 $2, $2, 0f4B000080;
sub.f32 $3, $3, 0f4B000080;
}""")


@triton.jit
def _w8_to_f32(w, INT8_ASM: tl.constexpr):
    """The weight block as float32 (INT8_ASM: int8 weights through ASM_I8_F32, compiled only)."""
    if INT8_ASM:
        f = tl.inline_asm_elementwise(ASM_I8_F32, "=r,=r,=r,=r,r", [w], dtype=tl.float32,
                                      is_pure=True, pack=4)
    else:
        f = w.to(tl.float32)
    return f


# NOTE: nothing that changes with the batch is specialised on: M, x's row stride; nor the K
# loop's trip count and split, so layers of one kind share a compiled variant.
@triton.jit(do_not_specialize=["M", "stride_am", "stride_cm", "stride_rm", "K_ITERS",
                               "SPLIT_K"])
def _w8_gemv_kernel(
    a_ptr, w_ptr, s_ptr, part_ptr, lock_ptr, c_ptr, nw_ptr, res_ptr, ss_ptr, eps,
    M, N, K, stride_am, stride_wn, stride_cm, stride_rm, K_ITERS, SPLIT_K, scale_cols,
    BLOCK_SCALE: tl.constexpr, BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SPLIT: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, FORM: tl.constexpr = 0,
    GATED: tl.constexpr = False, INT8_ASM: tl.constexpr = False,
    NORMED: tl.constexpr = False, HAS_RES: tl.constexpr = False,
    SILU_OUT: tl.constexpr = False, EVEN_N: tl.constexpr = False,
):
    """FORM: how a K block's products are summed; GATED: x is silu(h[:K]) * h[K:] of the rows h
    (M, 2K) at a_ptr, computed as they are read (_row_dot); INT8_ASM: int8 weights converted by
    inline PTX (_w8_to_f32). NORMED (one row): x is RMSNorm(h) with weight nw_ptr and eps, h
    the row at a_ptr: the sums of w * h * nw times 1 / rms(h), whose sum of squares accumulates
    as the K loop reads h (_row_dot_normed); split, each program stores its share at ss_ptr
    for the split-K finish. HAS_RES: the output rows are the residual rows at res_ptr plus the
    product (add_residual). SILU_OUT (one row, unsplit): the weight's rows are N / 2 gate rows
    then their N / 2 up rows; a program reads BLOCK_N / 2 channels of each, side by side, and
    writes silu(gate) * up (store_silu_pairs), N / 2 values. EVEN_N: every column tile is
    whole (no row masks)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    if SILU_OUT:  # gate channel c and its up channel c + N / 2 side by side
        pair = tl.arange(0, BLOCK_N)  # (BN,)
        gate_ch = pid_n * (BLOCK_N // 2) + pair // 2
        offs_n = gate_ch + (pair % 2) * (N // 2)
        n_mask = gate_ch < N // 2
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
        n_mask = offs_n < N
    if EVEN_N:  # every tile whole: no row masks
        # NOTE: they cost registers: sm_90, INT8 gate/up with the activation, 75 with them and 64
        # without; at Llama-3-8B's 896 such programs, 75 left a second wave (H200: 38.0 against
        # 30.8 us a call).
        n_mask = tl.arange(0, BLOCK_N) < BLOCK_N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BN, 1)
    k_end = (split + 1) * K_ITERS * BLOCK_K  # this program's K range ends here
    if PREFETCH:  # each block's weights load an iteration ahead (the first before the wait)
        nxt_w, nxt_s = _w8_block(w_rows, s_ptr, offs_n, n_mask, split * K_ITERS * BLOCK_K, K,
                                 k_end, scale_cols, BLOCK_SCALE, BN_SCALE, BK_SCALE, BLOCK_K)
    pdl_wait(PDL)
    acc0 = _w8_acc(BLOCK_N, BLOCK_K, FORM)
    acc1 = _w8_acc(BLOCK_N, BLOCK_K, FORM)
    acc2 = _w8_acc(BLOCK_N, BLOCK_K, FORM)
    acc3 = _w8_acc(BLOCK_N, BLOCK_K, FORM)
    acc4 = _w8_acc(BLOCK_N, BLOCK_K, FORM)
    acc5 = _w8_acc(BLOCK_N, BLOCK_K, FORM)
    acc6 = _w8_acc(BLOCK_N, BLOCK_K, FORM)
    acc7 = _w8_acc(BLOCK_N, BLOCK_K, FORM)
    sq = tl.zeros((BLOCK_K,), dtype=tl.float32)  # NORMED: the row's squares, summed at the end
    for it in range(0, K_ITERS):
        k0 = (split * K_ITERS + it) * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)  # (BK,)
        k_mask = offs_k < K
        if PREFETCH:
            w, s = nxt_w, nxt_s
            nxt_w, nxt_s = _w8_block(w_rows, s_ptr, offs_n, n_mask, k0 + BLOCK_K, K, k_end,
                                     scale_cols, BLOCK_SCALE, BN_SCALE, BK_SCALE, BLOCK_K)
        else:
            w, s = _w8_block(w_rows, s_ptr, offs_n, n_mask, k0, K, K, scale_cols, BLOCK_SCALE,
                             BN_SCALE, BK_SCALE, BLOCK_K)
        w = _w8_to_f32(w, INT8_ASM)  # (BN, BK)
        if BLOCK_SCALE:
            w = w * s[:, None]
        if NORMED:
            part0, sq0 = _row_dot_normed(w, a_ptr, nw_ptr, offs_k, k_mask, FORM)
            acc0 += part0
            sq += sq0
        else:
            acc0 += _row_dot(w, a_ptr, 0, M, stride_am, offs_k, k_mask, K, FORM, GATED)
        if BLOCK_M > 1:
            acc1 += _row_dot(w, a_ptr, 1, M, stride_am, offs_k, k_mask, K, FORM, GATED)
        if BLOCK_M > 2:
            acc2 += _row_dot(w, a_ptr, 2, M, stride_am, offs_k, k_mask, K, FORM, GATED)
            acc3 += _row_dot(w, a_ptr, 3, M, stride_am, offs_k, k_mask, K, FORM, GATED)
        if BLOCK_M > 4:
            acc4 += _row_dot(w, a_ptr, 4, M, stride_am, offs_k, k_mask, K, FORM, GATED)
            acc5 += _row_dot(w, a_ptr, 5, M, stride_am, offs_k, k_mask, K, FORM, GATED)
            acc6 += _row_dot(w, a_ptr, 6, M, stride_am, offs_k, k_mask, K, FORM, GATED)
            acc7 += _row_dot(w, a_ptr, 7, M, stride_am, offs_k, k_mask, K, FORM, GATED)
    s = tl.full((BLOCK_N,), 1.0, tl.float32)
    if not BLOCK_SCALE:  # one scale per output channel, applied once to the sums
        s = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
    if NORMED:  # 1 / rms of the whole row: this program read it all, or the splits' parts
        if HAS_SPLIT:  # this split's share; the column tile's last program adds them up
            tl.store(ss_ptr + pid_n * SPLIT_K + split, tl.sum(sq, axis=0))
        else:
            s = s * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    pdl_release(PDL)
    if SILU_OUT:
        store_silu_pairs(c_ptr, _w8_sums(acc0, FORM) * s, pid_n, N // 2, BLOCK_N)
        return
    store_partial(part_ptr, c_ptr, _w8_sums(acc0, FORM) * s, 0, M, N, split, offs_n, n_mask,
                  stride_cm, HAS_SPLIT, res_ptr, stride_rm, HAS_RES)
    if BLOCK_M > 1:
        store_partial(part_ptr, c_ptr, _w8_sums(acc1, FORM) * s, 1, M, N, split, offs_n,
                      n_mask, stride_cm, HAS_SPLIT, res_ptr, stride_rm, HAS_RES)
    if BLOCK_M > 2:
        store_partial(part_ptr, c_ptr, _w8_sums(acc2, FORM) * s, 2, M, N, split, offs_n,
                      n_mask, stride_cm, HAS_SPLIT, res_ptr, stride_rm, HAS_RES)
        store_partial(part_ptr, c_ptr, _w8_sums(acc3, FORM) * s, 3, M, N, split, offs_n,
                      n_mask, stride_cm, HAS_SPLIT, res_ptr, stride_rm, HAS_RES)
    if BLOCK_M > 4:
        store_partial(part_ptr, c_ptr, _w8_sums(acc4, FORM) * s, 4, M, N, split, offs_n,
                      n_mask, stride_cm, HAS_SPLIT, res_ptr, stride_rm, HAS_RES)
        store_partial(part_ptr, c_ptr, _w8_sums(acc5, FORM) * s, 5, M, N, split, offs_n,
                      n_mask, stride_cm, HAS_SPLIT, res_ptr, stride_rm, HAS_RES)
        store_partial(part_ptr, c_ptr, _w8_sums(acc6, FORM) * s, 6, M, N, split, offs_n,
                      n_mask, stride_cm, HAS_SPLIT, res_ptr, stride_rm, HAS_RES)
        store_partial(part_ptr, c_ptr, _w8_sums(acc7, FORM) * s, 7, M, N, split, offs_n,
                      n_mask, stride_cm, HAS_SPLIT, res_ptr, stride_rm, HAS_RES)
    finish_split_k(part_ptr, lock_ptr, c_ptr, M, N, pid_n, offs_n, n_mask, stride_cm,
                   SPLIT_K, HAS_SPLIT, BLOCK_M, BLOCK_N, res_ptr, stride_rm, HAS_RES, ss_ptr,
                   eps, K, NORMED)


class GemvConfig(NamedTuple):
    """A GEMV launch: column and K tile sizes, the K split, K tiles per program, warps, and
    for a variant that streams its blocks through shared memory, the blocks in flight."""

    block_n: int
    block_k: int
    split_k: int
    k_iters: int
    num_warps: int
    num_stages: int = 1


_W8_BLOCK_N = 32
_W8_BLOCK_K = 256
_W8_WAVES = _WAVES
# The K loop's form (_row_dot) unless a call names one. H200, Llama-3-8B, one row: form 1
# 64.7 us a layer against 69.1 (gate/up 29.1 against 33.3, 96% of HBM), two rows 77.4
# against 83.5; FP8 W8A8 batch-1 decode 366 against 360 tok/s.
_W8_FORM = 1
# One row with per-channel scales: where 16-column tiles alone launch this many programs per SM
# and the default tile would split K, no split (16-column tiles, 8 warps): the split-K epilogue
# (a ticket, then the last program's pass over the partials) is a visible share of a short GEMV.
# Llama-3-8B's qkv (6144 x 4096, 2.9 programs per SM) on an H200: 8.5 against 10.3 us a call,
# FP8 W8A8 batch-1 decode +0.9%; its o (4096 x 4096, 1.94 per SM) too: 381.6 / 381.8 against
# 379.3 / 379.5 tok/s. 0 turns it off.
_W8_NARROW_WAVES = 1.9
# The unsplit tile's K block: the narrowest of 512 to _W8_NARROW_MAX_BLOCK_K inputs whose
# weight bytes, over the programs an SM runs, reach _W8_NARROW_BYTES an iteration (a program
# asks for one block at a time, so the bytes in flight over an SM set the pace; asking for the
# next block while summing one, `prefetch`, measured slower end to end). Llama-3-8B, H200, us a
# call: qkv 1,024 inputs 8.08 against 8.51 with 512; o 2,048 5.87 against 7.22; the down
# projection unsplit at 2,048 16.03 against 17.94 split 8 ways; FP8 W8A8 batch-1 decode 405.3
# against 394.2 tok/s.
_W8_NARROW_BYTES = 32 << 10
_W8_NARROW_MAX_BLOCK_K = 2048
# Only where a program then reads at most this many blocks: Llama-2-70B's qkv and o (K 8192)
# lost 3.4% unsplit with 16 blocks of 512 (at 8 of 1,024, their width by the rule above, they
# are not measured).
_W8_NARROW_K_ITERS = 7
# Warps of an unsplit tile's program. FP8 W8A8 batch-1 decode, one run: 8 warps 408.4 / 408.5
# tok/s, 16 warps 404.8 / 404.9 (the per-call sweep: 4 warps slower at every width).
_W8_NARROW_WARPS = 8


def _narrow_block_k(n: int, k: int, device: torch.device) -> int:
    """The unsplit one-row tile's K block for an (n, k) weight (_W8_NARROW_BYTES)."""
    per_sm = triton.cdiv(n, 16) / _sms(device)
    block_k = 512
    while block_k < _W8_NARROW_MAX_BLOCK_K and 16 * block_k * per_sm < _W8_NARROW_BYTES:
        block_k *= 2
    return block_k


def w8_gemv_config(m: int, n: int, k: int, block: tuple[int, int] | None,
                   device: torch.device) -> GemvConfig:
    """Tiles of 32 output channels x 256 weight bytes along K (less when block scales are that
    narrow), K split to fill the SMs; one row of a projection wide enough for 16-column tiles to
    fill the SMs, and short enough along K, is not split (_W8_NARROW_WAVES, its K block wider
    where fewer such programs share an SM: _narrow_block_k). The default tile
    compiled for sm_90 (FP8, form 1): 4 warps at 1 / 2 rows take 58 / 90 registers and about
    3.8 / 5.6 instructions per weight value in the K loop (4.3 / 6.6 with form 0's per-block
    shuffles); 8 warps at 4 / 8 rows 80 / 99 registers and 11.9 / 21.8 per value (form 0)."""
    block_k = _W8_BLOCK_K
    if block is not None:
        while block_k > 16 and block[1] % block_k:
            block_k //= 2
    block_n = _W8_BLOCK_N
    tiles = triton.cdiv(n, block_n)
    split, k_iters = choose_split(tiles, triton.cdiv(k, block_k), device, _W8_WAVES)
    if (m == 1 and block is None and split > 1 and _W8_NARROW_WAVES
            and triton.cdiv(n, 16) >= _W8_NARROW_WAVES * _sms(device)):
        narrow_k = _narrow_block_k(n, k, device)
        if triton.cdiv(k, narrow_k) <= _W8_NARROW_K_ITERS:
            return GemvConfig(16, narrow_k, 1, triton.cdiv(k, narrow_k), _W8_NARROW_WARPS)
    return GemvConfig(block_n, block_k, split, k_iters, 4 if m <= 2 else 8)


def w8_gemv_supported(weight: torch.Tensor, block: tuple[int, int] | None = None) -> bool:
    """Whether w8_gemv reads this weight: (N, K) row-major FP8 e4m3 or int8, block scales
    whose K width is a multiple of 16."""
    return (weight.dtype in (torch.float8_e4m3fn, torch.int8) and weight.dim() == 2
            and weight.stride(1) == 1 and (block is None or block[1] % 16 == 0))


@functools.lru_cache(maxsize=8)
def _has_fp8_cvt(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def w8_gemv_ready(weight: torch.Tensor, block: tuple[int, int] | None = None) -> bool:
    """Whether w8_gemv serves this weight on its device: CUDA, a supported layout, and for FP8
    compute capability 8.9+ (Triton's e4m3 conversions)."""
    if not (weight.is_cuda and w8_gemv_supported(weight, block)):
        return False
    return weight.dtype == torch.int8 or _has_fp8_cvt(weight.device.index or 0)


def w8_gemv_takes_norm(rows: int) -> bool:
    """Whether w8_gemv(norm=...) serves `rows` rows: one (each program sums the squares of its
    part of the row; a split launch's last program of a column tile adds the parts)."""
    return rows == 1


def w8_gemv_takes_silu_out(rows: int, n: int, k: int, block: tuple[int, int] | None,
                           device: torch.device) -> bool:
    """Whether w8_gemv(silu_out=True) serves `rows` rows of an (n, k) gate-and-up weight: one
    row whose launch is not split along K."""
    return rows == 1 and n % 2 == 0 and w8_gemv_config(1, n, k, block, device).split_k == 1


def w8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
            block: tuple[int, int] | None = None,
            config: GemvConfig | None = None, prefetch: bool = False,
            form: int | None = None, gated: bool = False,
            norm: tuple[torch.Tensor, float] | None = None,
            residual: torch.Tensor | None = None, silu_out: bool = False) -> torch.Tensor:
    """y (M, N) = x (M, K) @ (weight (N, K) * scale)^T in x's dtype, for M <= GEMV_MAX_ROWS.
    scale: (1, N) or (N, 1) per channel, or (ceil(N / bn), ceil(K / bk)) for block=(bn, bk).
    prefetch: each K block's weights are loaded an iteration ahead (the same sums).
    form: how the kernel sums a block's products (0 or 1: _row_dot; default _W8_FORM).
    gated: x is gate-and-up rows h (M, 2K) and the GEMV's input silu(h[:, :K]) * h[:, K:],
    computed as it is read: bit for bit the activation kernel's output fed to the GEMV, without
    its launch.
    norm = (norm weight (K,), eps): x is one row h of the residual stream and the GEMV's input
    RMSNorm(h) * norm weight, computed in float32 as it is read, 1 / rms(h) applied to the sums
    (no rounding of the normalised row: not the norm kernel's bits, closer to exact); one row
    (w8_gemv_takes_norm), and not with gated.
    residual (M, N) in x's dtype: the output is residual + the product, each rounded to x's
    dtype as the GEMV and then the norm kernel's residual add round them (the same bits).
    silu_out: the weight is a merged gate-and-up weight (N / 2 gate rows, then their up rows)
    and the output (1, N / 2) is silu(y[:, :N / 2]) * y[:, N / 2:] of the product y, computed
    in the epilogue: the bits of the GEMV and then the activation kernel; one row, an unsplit
    launch (w8_gemv_takes_silu_out), not with gated or residual."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != (2 * k if gated else k):
        raise ValueError(f"w8_gemv: x {tuple(x.shape)} does not match the weight ({n}, {k})"
                         f"{' (gated: twice its inputs)' if gated else ''}")
    if not w8_gemv_supported(weight, block):
        raise ValueError(f"w8_gemv: weight {weight.dtype} {tuple(weight.shape)} with block "
                         f"{block} is not supported (row-major fp8 e4m3 / int8, block K % 16)")
    if block is None:
        if scale.numel() != n:
            raise ValueError(f"w8_gemv: {scale.numel()} per-channel scales for {n} outputs")
        scale = scale.reshape(n).float().contiguous()
        scale_cols = 1
    else:
        want = (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
        if tuple(scale.shape) != want:
            raise ValueError(f"w8_gemv: block scales {tuple(scale.shape)}, expected {want}")
        scale = scale.float().contiguous()
        scale_cols = want[1]
    m = x.shape[0]
    a = x if x.stride(1) == 1 else x.contiguous()
    bm = block_m_for(m)
    cfg = config or w8_gemv_config(bm, n, k, block, x.device)
    if cfg.block_k & (cfg.block_k - 1) or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"w8_gemv: block_k {cfg.block_k} and block_n {cfg.block_n} must be "
                         "powers of two")
    form = _W8_FORM if form is None else form
    if form not in (0, 1) or (form == 1 and cfg.block_k < 16):
        raise ValueError(f"w8_gemv: form {form} with block_k {cfg.block_k} (forms 0 and 1; "
                         "form 1 sums 16 adjacent inputs per thread, so block_k >= 16)")
    if block is not None and block[1] % cfg.block_k:
        raise ValueError(f"w8_gemv: block_k {cfg.block_k} does not divide the scale blocks "
                         f"{block[1]}")
    norm_weight, eps = norm if norm is not None else (None, 0.0)
    if norm is not None:
        if m != 1 or gated or cfg.split_k > _MAX_SPLIT:
            raise ValueError(f"w8_gemv: norm takes one row, not gated, at most {_MAX_SPLIT} K "
                             f"splits (rows {m}, gated {gated}, split {cfg.split_k})")
        if norm_weight.shape != (k,) or not norm_weight.is_contiguous():
            raise ValueError(f"w8_gemv: norm weight {tuple(norm_weight.shape)} must be a "
                             f"contiguous ({k},)")
    if residual is not None and (residual.shape != (m, n) or residual.dtype != x.dtype
                                 or residual.stride(1) != 1):
        raise ValueError(f"w8_gemv: residual {residual.dtype} {tuple(residual.shape)} must be "
                         f"({m}, {n}) {x.dtype}, contiguous in its last dim")
    if silu_out and (m != 1 or gated or residual is not None or n % 2 or cfg.split_k != 1
                     or cfg.block_n < 2):
        raise ValueError(f"w8_gemv: silu_out takes one row, an even number of outputs, an "
                         f"unsplit launch, not gated nor residual (rows {m}, outputs {n}, "
                         f"split {cfg.split_k}, gated {gated}, residual "
                         f"{residual is not None})")
    tiles = triton.cdiv(n // 2, cfg.block_n // 2) if silu_out else triton.cdiv(n, cfg.block_n)
    out, part, lock = launch_buffers(a, n // 2 if silu_out else n, tiles, cfg.split_k)
    # NOTE: a split normed launch's sums of squares, one per (column tile, split)
    ssq = part if norm is None or cfg.split_k == 1 else \
        torch.empty(tiles * cfg.split_k, dtype=torch.float32, device=x.device)
    bn_scale, bk_scale = block if block is not None else (1, 1)
    _w8_gemv_kernel[(tiles, cfg.split_k)](
        a, weight, scale, part, lock, out,
        norm_weight if norm is not None else scale, residual if residual is not None else out,
        ssq, float(eps), m, n, k, a.stride(0), weight.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0,
        cfg.k_iters, cfg.split_k, scale_cols, BLOCK_SCALE=block is not None, BN_SCALE=bn_scale,
        BK_SCALE=bk_scale, BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        HAS_SPLIT=cfg.split_k > 1, PREFETCH=prefetch, FORM=form, GATED=gated,
        INT8_ASM=weight.dtype == torch.int8 and weight.is_cuda,
        NORMED=norm is not None, HAS_RES=residual is not None, SILU_OUT=silu_out,
        EVEN_N=(n // 2) % (cfg.block_n // 2) == 0 if silu_out else n % cfg.block_n == 0,
        num_warps=cfg.num_warps, **pdl_args(a))
    return out


def precompile_w8_gemv(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                       block: tuple[int, int] | None = None, gate_up: bool = False) -> None:
    """Compile this weight's GEMV for every row count it can serve (call at load time);
    gate_up: a merged gate-and-up weight, also with the activation in the epilogue."""
    if not w8_gemv_ready(weight, block):
        return
    n, k = weight.shape
    for rows in sorted({block_m_for(m) for m in range(1, W8_GEMV_MAX_M + 1)}):
        res = torch.zeros(rows, n, dtype=dtype, device=weight.device)
        for gated in (False, True):  # a down projection's form too (SiLU-and-mul inside)
            for residual in (None, res):  # and with the residual add (a row-parallel layer)
                w8_gemv(torch.zeros(rows, k * (2 if gated else 1), dtype=dtype,
                                    device=weight.device), weight, scale, block, gated=gated,
                        residual=residual)
    # a column-parallel layer after an RMSNorm, one row (a gate-and-up one: with the activation)
    norm = (torch.ones(k, dtype=dtype, device=weight.device), 1e-6)
    w8_gemv(torch.zeros(1, k, dtype=dtype, device=weight.device), weight, scale, block, norm=norm)
    if gate_up and w8_gemv_takes_silu_out(1, n, k, block, weight.device):
        w8_gemv(torch.zeros(1, k, dtype=dtype, device=weight.device), weight, scale, block,
                norm=norm, silu_out=True)
