"""The row-tile kernel's inner loop alone (kernels/decode_rows.py's chunk steps: int4 words
decoded to 16-bit pairs, then tensor-core MMAs at batch 1), in forms that differ in one thing
each, timed as µs for one Llama-3-8B layer's weights an SM (1.65 M 4-bit weights an SM of 132).

No weight stream, no waits, no finishes: each program loops over its 16 words a thread from
shared memory (`mma.sync` forms) or from registers varied by the loop counter (`wgmma` forms),
four warps a program, 1 to 4 programs an SM. The forms:

- `sync`, `bf16`: the kernel's steps: a word's four pairs by a mask (lop3) each and three
  shifts, two m16n8k16 MMAs a step of two words, and (with sums) two more with all-ones A for
  the input sums that take the zero points out;
- `sync`, `bf16-mulhi`: the shifts as multiplies (mul.hi by a register's power of two);
- `sync`, `fp16`: fp16 pairs, whose 10-bit mantissa takes the nibble at bits 4-7 in place
  (1024 + 16 q): four masks and one shift a word;
- `sync`, `bf16` or `fp16` with sums 2: no sum MMAs; each decoded pair less its channel's
  zero point (bf16: less 128 + z; fp16: less 1024 + z, or times 1/16 less 64 + z for the
  nibbles in place at bits 4-7; q - z exactly either way), so the MMAs sum (q - z) x and a
  group's end only scales;
- `wgmma`: a warpgroup's m64n8k16 MMA with A (the decoded pairs) from registers and B from
  shared memory, each warp's 16 rows a different group; sums none, `ones` (a second MMA with
  all-ones A), or `hsub` (the zero point subtracted from each pair in the decode, sub.bf16x2);
- `imma`, `u8`: the nibbles as bytes for the 8-bit integer MMA (m16n8k32, u8 weights times s8
  inputs, int32 sums): a word's even nibbles by one mask (q) and its odd ones by another (16 q,
  in a second accumulator set), so a word costs two integer instructions and four words two
  MMAs; x would be two int8 parts a group (hi and lo, in B's columns 0 and 1), made once a
  projection, and a group's input sum with it (no sum MMAs). A group's end: 16 E + O a column,
  to float32 by the 2^23 + 2^22 offset, and hi + lo / 254.

The outputs are not checked (the inputs are arbitrary bits): this measures throughput only.

    python benchmarks/int4_step_bench.py --out /tmp/out/int4_step.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared,
                                                              warpgroup_mma, warpgroup_mma_wait)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import write_results  # noqa: E402
from peregrine.kernels._gluon import cta_barrier  # noqa: E402
from peregrine.kernels.wna16_gemv_tc import _SUM_BF16, _SUM_F16  # noqa: E402

WORDS = 16  # words a thread an iteration: a chunk's share of a consumer warp's lane
_WORDS = gl.constexpr(WORDS)
LAYER_WEIGHTS_AN_SM = 218.1e6 / 132  # Llama-3-8B's 4-bit weights a layer, an SM's share


def _step_asm(decode: str, sub: bool = False) -> str:
    """PTX: words $4 (rows g) and $5 (rows g + 8) decoded, the two MMAs of a step with B pairs
    $6..$9 onto C $10..$13 (out $0..$3); $14..$16 the mul.hi multipliers (2^28, 2^24, 2^20);
    sub: each pair less its zero point: bf16, less $17 (rows g) or $18 (rows g + 8), the
    128 + z pairs; fp16, the nibbles at bits 0-3 less $17 / $18 (1024 + z) and those at bits
    4-7 (1024 + 16 q) times 1/16 plus $19 / $20 (-(64 + z)), q - z exactly either way."""
    f16 = decode == "fp16"
    magic = "0x64006400" if f16 else "0x43004300"
    kind = "f16.f16" if f16 else "bf16.bf16"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.f32"
    lines = ["{", ".reg .b32 l0, l1, l2, l3, h0, h1, h2, h3, t;"]
    if f16 and sub:
        lines += [".reg .b32 r16;", "mov.b32 r16, 0x2C002C00;"]  # (1/16, 1/16)
    for src, dst in (("$4", "l"), ("$5", "h")):
        if f16:
            lines += [f"lop3.b32 {dst}0, {src}, 0x000F000F, {magic}, 0xEA;",
                      f"lop3.b32 {dst}1, {src}, 0x00F000F0, {magic}, 0xEA;",
                      f"shr.u32 t, {src}, 8;",
                      f"lop3.b32 {dst}2, t, 0x000F000F, {magic}, 0xEA;",
                      f"lop3.b32 {dst}3, t, 0x00F000F0, {magic}, 0xEA;"]
            if sub:
                z, nz = ("$17", "$19") if dst == "l" else ("$18", "$20")
                lines += [f"sub.rn.f16x2 {dst}0, {dst}0, {z};",
                          f"fma.rn.f16x2 {dst}1, {dst}1, r16, {nz};",
                          f"sub.rn.f16x2 {dst}2, {dst}2, {z};",
                          f"fma.rn.f16x2 {dst}3, {dst}3, r16, {nz};"]
            continue
        lines.append(f"lop3.b32 {dst}0, {src}, 0x000F000F, {magic}, 0xEA;")
        for j in (1, 2, 3):
            if decode == "bf16-mulhi":
                lines.append(f"mul.hi.u32 t, {src}, ${13 + j};")
            else:
                lines.append(f"shr.u32 t, {src}, {4 * j};")
            lines.append(f"lop3.b32 {dst}{j}, t, 0x000F000F, {magic}, 0xEA;")
        if sub:
            lines += [f"sub.rn.bf16x2 {dst}{j}, {dst}{j}, ${17 if dst == 'l' else 18};"
                      for j in range(4)]
    lines += [f"{mma} {{$0, $1, $2, $3}}, {{l0, h0, l1, h1}}, {{$6, $7}}, {{$10, $11, $12, $13}};",
              f"{mma} {{$0, $1, $2, $3}}, {{l2, h2, l3, h3}}, {{$8, $9}}, {{$0, $1, $2, $3}};",
              "}"]
    return "\n".join(lines)


_STEP_BF16 = gl.constexpr(_step_asm("bf16"))
_STEP_MULHI = gl.constexpr(_step_asm("bf16-mulhi"))
_STEP_F16 = gl.constexpr(_step_asm("fp16"))
_STEP_SUB = gl.constexpr(_step_asm("bf16", sub=True))
_STEP_F16_SUB = gl.constexpr(_step_asm("fp16", sub=True))
_STEP_CONS = gl.constexpr("=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f,r,r,r")
_STEP_SUB_CONS = gl.constexpr("=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f,r,r,r,r,r,r,r")
_SUM_CONS = gl.constexpr("=f,=f,=f,=f,r,r,r,r,r,f,f,f,f")
DECODES = {"bf16": 0, "bf16-mulhi": 1, "fp16": 2}
# PTX: words $8..$11 (rows g, g + 8 of one step, then of the next) as bytes, the even nibbles
# (mask) onto E ($16..$19, out $0..$3) with B $12, $13 and the odd ones (16 q) onto O ($20..$23,
# out $4..$7) with B $14, $15
_IMMA = gl.constexpr("\n".join(
    ["{", ".reg .b32 e0, e1, e2, e3, o0, o1, o2, o3;"]
    + [f"and.b32 e{j}, ${8 + j}, 0x0F0F0F0F;" for j in range(4)]
    + [f"and.b32 o{j}, ${8 + j}, 0xF0F0F0F0;" for j in range(4)]
    + ["mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {$0, $1, $2, $3}, {e0, e1, e2, e3}, "
       "{$12, $13}, {$16, $17, $18, $19};",
       "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {$4, $5, $6, $7}, {o0, o1, o2, o3}, "
       "{$14, $15}, {$20, $21, $22, $23};", "}"]))
_IMMA_CONS = gl.constexpr(",".join(["=r"] * 8 + ["r"] * 16))


@gluon.jit
def _mma_step(D: gl.constexpr, lo, hi, b, c, m1, m2, m3, zp=None):
    if zp is not None:  # (bf16: $19, $20 unused)
        ASM_SUB: gl.constexpr = _STEP_F16_SUB if D == 2 else _STEP_SUB
        r = gl.inline_asm_elementwise(ASM_SUB, _STEP_SUB_CONS,
                                      [lo, hi, b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3],
                                       m1, m2, m3, zp[0], zp[1], zp[2], zp[3]],
                                      dtype=(gl.float32,) * 4, is_pure=True, pack=1)
    else:
        ASM: gl.constexpr = _STEP_BF16 if D == 0 else (_STEP_MULHI if D == 1 else _STEP_F16)
        r = gl.inline_asm_elementwise(ASM, _STEP_CONS,
                                      [lo, hi, b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3],
                                       m1, m2, m3], dtype=(gl.float32,) * 4, is_pure=True,
                                      pack=1)
    return r[0], r[1], r[2], r[3]


@gluon.jit
def _sum_step(D: gl.constexpr, ones, b, c):
    ASM: gl.constexpr = _SUM_F16 if D == 2 else _SUM_BF16
    r = gl.inline_asm_elementwise(ASM, _SUM_CONS,
                                  [ones, b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3]],
                                  dtype=(gl.float32,) * 4, is_pure=True, pack=1)
    return r[0], r[1], r[2], r[3]


@gluon.jit
def _stage_words(words_ptr, LW: gl.constexpr):
    """The 16 x 512 words at words_ptr in shared memory (a thread's 16 words an iteration come
    from one of four slots of four)."""
    wsm = gl.allocate_shared_memory(gl.int32, [_WORDS, 128, 4],
                                    gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    r = gl.arange(0, 128, layout=gl.SliceLayout(1, LW))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, LW))
    off = gl.expand_dims(r, 1) * 4 + gl.expand_dims(q, 0)
    for s in gl.static_range(_WORDS):
        wsm.index(s).store(gl.load(words_ptr + s * 512 + off))
    cta_barrier()
    return wsm


@gluon.jit
def _slot_words(wsm, slot, LW: gl.constexpr, L: gl.constexpr):
    """A thread's 16 words of slots slot .. slot + 3, as a tuple."""
    ws = ()
    for k in gl.static_range(4):
        wl = wsm.index(slot + k).load(LW)
        pa, pb = gl.split(gl.reshape(wl, [128, 2, 2]))
        w0, w1 = gl.split(pa)
        w2, w3 = gl.split(pb)
        ws = ws + (gl.convert_layout(w0, L), gl.convert_layout(w1, L),
                   gl.convert_layout(w2, L), gl.convert_layout(w3, L))
    return ws


@gluon.jit
def steps_sync(out_ptr, words_ptr, iters, m1s, m2s, m3s, D: gl.constexpr, SUMS: gl.constexpr):
    """Two groups of four steps an iteration a warp (even and odd steps in two accumulator
    sets, as the kernel), 16 words a thread from one of four shared-memory slots."""
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    LW: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [4, 1], [1, 0])
    pid = gl.program_id(0)
    idx = gl.arange(0, 128, layout=L)
    wsm = _stage_words(words_ptr, LW)
    m1 = gl.full([128], 0, gl.int32, layout=L) + m1s
    m2 = gl.full([128], 0, gl.int32, layout=L) + m2s
    m3 = gl.full([128], 0, gl.int32, layout=L) + m3s
    if D == 2:
        ones = gl.full([128], 0x3C003C00, gl.int32, layout=L)
    else:
        ones = gl.full([128], 0x3F803F80, gl.int32, layout=L)
    bx = (ones, ones ^ 0x10001, ones ^ 0x20002, ones ^ 0x30003)
    z = gl.zeros([128], gl.float32, layout=L)
    tot = z
    for i in range(iters):
        ws = _slot_words(wsm, (i % 4) * 4, LW, L)
        for h in gl.static_range(2):
            acc_e = (z, z, z, z)
            acc_o = (z, z, z, z)
            cx_e = (z, z, z, z)
            cx_o = (z, z, z, z)
            zp = None
            if SUMS == 2:  # (a group's zero point pairs: from its words, as stand-ins)
                zw = ws[8 * h]
                if D == 2:
                    zp = ((zw & 0x000F000F) | 0x64006400, ((zw >> 4) & 0x000F000F) | 0x64006400,
                          ((zw >> 4) & 0x00F000F0) | -0x2BFF2C00, (zw & 0x00F000F0) | -0x2BFF2C00)
                else:
                    zp = ((zw & 0x000F000F) | 0x43004300, ((zw >> 4) & 0x000F000F) | 0x43004300,
                          zw, zw)
            for s in gl.static_range(4):
                # (B differs a step and a group, so that no MMA repeats another)
                bb = (bx[s % 4] ^ (h << 8), bx[(s + 1) % 4], bx[(s + 2) % 4], bx[(s + 3) % 4])
                lo = ws[8 * h + 2 * s]
                hi = ws[8 * h + 2 * s + 1]
                if s % 2 == 0:
                    acc_e = _mma_step(D, lo, hi, bb, acc_e, m1, m2, m3, zp)
                    if SUMS == 1:
                        cx_e = _sum_step(D, ones, bb, cx_e)
                else:
                    acc_o = _mma_step(D, lo, hi, bb, acc_o, m1, m2, m3, zp)
                    if SUMS == 1:
                        cx_o = _sum_step(D, ones, bb, cx_o)
            tot = tot + (acc_e[0] + acc_o[0]) * 0.5 - (cx_e[0] + cx_o[0]) * 136.0
    gl.store(out_ptr + pid * 128 + idx, tot)


@gluon.jit
def _imma_pair(ws, b, e, o):
    """Four words (ws), four B registers (b): the even nibbles' MMA onto e, the odd ones' onto
    o (4 int32 registers each)."""
    r = gl.inline_asm_elementwise(_IMMA, _IMMA_CONS,
                                  [ws[0], ws[1], ws[2], ws[3], b[0], b[1], b[2], b[3], e[0],
                                   e[1], e[2], e[3], o[0], o[1], o[2], o[3]],
                                  dtype=(gl.int32,) * 8, is_pure=True, pack=1)
    return (r[0], r[1], r[2], r[3]), (r[4], r[5], r[6], r[7])


@gluon.jit
def _i2f(v):
    """int32 v (|v| < 2^22) as float32: its bits added to those of 1.5 * 2^23, less that."""
    return (v + 0x4B400000).to(gl.float32, bitcast=True) - 12582912.0


@gluon.jit
def steps_imma(out_ptr, words_ptr, iters):
    """Two groups of two MMA pairs (four words each) an iteration a warp, 16 words a thread from
    one of four shared-memory slots (as steps_sync), then each group's end: its C columns 0 and
    1 (hi, lo) as 16 E + O, scaled into the total."""
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    LW: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [4, 1], [1, 0])
    pid = gl.program_id(0)
    idx = gl.arange(0, 128, layout=L)
    wsm = _stage_words(words_ptr, LW)
    bx = idx * 0x01030507
    bs = (bx, bx ^ 0x10101010, bx ^ 0x20202020, bx ^ 0x30303030)
    zi = gl.zeros([128], gl.int32, layout=L)
    z = gl.zeros([128], gl.float32, layout=L)
    tot = z
    for i in range(iters):
        ws = _slot_words(wsm, (i % 4) * 4, LW, L)
        for h in gl.static_range(2):
            e = (zi, zi, zi, zi)
            o = (zi, zi, zi, zi)
            for p in gl.static_range(2):
                # (B differs a pair and a group, so that no MMA repeats another)
                bb = (bs[p] ^ (h << 8), bs[p + 1], bs[p + 2] ^ h, bs[(p + 3) % 4])
                e, o = _imma_pair((ws[8 * h + 4 * p], ws[8 * h + 4 * p + 1],
                                   ws[8 * h + 4 * p + 2], ws[8 * h + 4 * p + 3]), bb, e, o)
            hi = _i2f(e[0] * 16 + o[0])
            lo = _i2f(e[1] * 16 + o[1])
            hi8 = _i2f(e[2] * 16 + o[2])
            lo8 = _i2f(e[3] * 16 + o[3])
            tot = tot + (hi + lo * (1.0 / 254.0)) * 0.5 + (hi8 + lo8 * (1.0 / 254.0)) * 0.25
    gl.store(out_ptr + pid * 128 + idx, tot)


_DEC_PAIRS = ("{ .reg .b32 t;\n"
              "lop3.b32 $0, $4, 0x000F000F, 0x43004300, 0xEA;\n"
              "shr.u32 t, $4, 4;\nlop3.b32 $1, t, 0x000F000F, 0x43004300, 0xEA;\n"
              "shr.u32 t, $4, 8;\nlop3.b32 $2, t, 0x000F000F, 0x43004300, 0xEA;\n"
              "shr.u32 t, $4, 12;\nlop3.b32 $3, t, 0x000F000F, 0x43004300, 0xEA;\n")
_DEC = gl.constexpr(_DEC_PAIRS + "}")
_DEC_SUB = gl.constexpr(_DEC_PAIRS + "sub.rn.bf16x2 $0, $0, $12;\nsub.rn.bf16x2 $1, $1, $13;\n"
                        "sub.rn.bf16x2 $2, $2, $12;\nsub.rn.bf16x2 $3, $3, $13;\n}")


@gluon.jit
def _dec(w, zp, SUB: gl.constexpr):
    """A word (the same in a thread's 8 elements of the A operand) as its 4 bf16 pairs."""
    if SUB:
        r = gl.inline_asm_elementwise(_DEC_SUB, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                                      [w, zp],
                                      dtype=gl.bfloat16, is_pure=False, pack=8)
    else:
        r = gl.inline_asm_elementwise(_DEC, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [w],
                                      dtype=gl.bfloat16, is_pure=False, pack=8)
    return r


@gluon.jit
def _wg_group(w0, j0: gl.constexpr, zp, ones, bs, tot, SUMS: gl.constexpr):
    """A group's 8 MMAs (words w0 ^ (j0 + j)) into a fresh accumulator, with SUMS 1 the input
    sums' 8 more; returns the accumulators and the A operands to keep until they are read."""
    a0 = _dec(w0 ^ j0, zp, SUMS == 2)
    a1 = _dec(w0 ^ (j0 + 1), zp, SUMS == 2)
    a2 = _dec(w0 ^ (j0 + 2), zp, SUMS == 2)
    a3 = _dec(w0 ^ (j0 + 3), zp, SUMS == 2)
    a4 = _dec(w0 ^ (j0 + 4), zp, SUMS == 2)
    a5 = _dec(w0 ^ (j0 + 5), zp, SUMS == 2)
    a6 = _dec(w0 ^ (j0 + 6), zp, SUMS == 2)
    a7 = _dec(w0 ^ (j0 + 7), zp, SUMS == 2)
    acc = warpgroup_mma(a0, bs, tot, use_acc=False, is_async=True)
    acc = warpgroup_mma(a1, bs, acc, is_async=True)
    acc = warpgroup_mma(a2, bs, acc, is_async=True)
    acc = warpgroup_mma(a3, bs, acc, is_async=True)
    acc = warpgroup_mma(a4, bs, acc, is_async=True)
    acc = warpgroup_mma(a5, bs, acc, is_async=True)
    acc = warpgroup_mma(a6, bs, acc, is_async=True)
    acc = warpgroup_mma(a7, bs, acc, is_async=True)
    sm = tot
    if SUMS == 1:
        sm = warpgroup_mma(ones, bs, tot, use_acc=False, is_async=True)
        for _ in gl.static_range(7):
            sm = warpgroup_mma(ones, bs, sm, is_async=True)
    return acc, sm, (a0, a1, a2, a3, a4, a5, a6, a7)


@gluon.jit
def steps_wgmma(out_ptr, seed, iters, SUMS: gl.constexpr):
    """Two groups of 8 m64n8k16 MMAs an iteration a warpgroup (a word a thread each), the
    first group's results waited for once the second's are issued."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 8, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    BL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    BI: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0])
    pid = gl.program_id(0)
    # (each group its own B, as two groups' inputs are, so that no MMA repeats another)
    bs = gl.allocate_shared_memory(gl.bfloat16, [16, 8], BL)
    bs.store(gl.full([16, 8], 1.0, gl.bfloat16, BI))
    bs2 = gl.allocate_shared_memory(gl.bfloat16, [16, 8], BL)
    bs2.store(gl.full([16, 8], 2.0, gl.bfloat16, BI))
    fence_async_shared()
    m = gl.arange(0, 64, layout=gl.SliceLayout(1, DOT))
    k = gl.arange(0, 16, layout=gl.SliceLayout(0, DOT))
    # (a thread's 8 elements: rows g, g + 8 of its warp, inputs 2t, 2t + 1, 2t + 8, 2t + 9)
    base = (gl.expand_dims(((m % 8) * 4 + (m // 16) * 32) * 40503, 1)
            + gl.expand_dims(((k % 8) // 2) * 7919, 0)) ^ (seed + pid)
    zp = gl.expand_dims(m % 8, 1) * 0x00010001 + 0x43014301 + gl.expand_dims(k * 0, 0)
    ones = gl.full([64, 16], 1.0, gl.bfloat16, DOT)
    tot = gl.zeros([64, 8], gl.float32, ACC)
    for i in range(iters):
        w0 = base ^ (i * _WORDS)
        acc, sm, a = _wg_group(w0, 0, zp, ones, bs, tot, SUMS)
        acd, sd, b = _wg_group(w0, 8, zp, ones, bs2, tot, SUMS)
        n_later: gl.constexpr = 16 if SUMS == 1 else 8
        acc, sm, a0, a1, a2, a3, a4, a5, a6, a7 = warpgroup_mma_wait(
            n_later, deps=[acc, sm, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]])
        tot = tot + (acc - sm * 136.0) * 0.5
        acd, sd, b0, b1, b2, b3, b4, b5, b6, b7 = warpgroup_mma_wait(
            0, deps=[acd, sd, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
        tot = tot + (acd - sd * 136.0) * 0.5
    mm = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
    nn = gl.arange(0, 8, layout=gl.SliceLayout(0, ACC))
    gl.store(out_ptr + pid * 512 + gl.expand_dims(mm, 1) * 8 + gl.expand_dims(nn, 0), tot)


FORMS = [("sync", "bf16", 1), ("sync", "bf16", 0), ("sync", "bf16", 2), ("sync", "bf16-mulhi", 1),
         ("sync", "bf16-mulhi", 0), ("sync", "fp16", 1), ("sync", "fp16", 0), ("sync", "fp16", 2),
         ("wgmma", "ones", 1), ("wgmma", "none", 0), ("wgmma", "hsub", 2), ("imma", "u8", 0)]


def launch(form, grid, out, words, iters) -> None:
    kind, what, sums = form
    if kind == "sync":
        steps_sync[grid](out, words, iters, 1 << 28, 1 << 24, 1 << 20, DECODES[what], sums,
                         num_warps=4)
    elif kind == "imma":
        steps_imma[grid](out, words, iters, num_warps=4)
    else:
        steps_wgmma[grid](out, 1, iters, sums, num_warps=4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=4000)
    p.add_argument("--per-sm", default="1,2,3,4", help="programs an SM, comma-separated")
    p.add_argument("--forms", default="", help="kinds to time (sync, wgmma, imma; all if empty)")
    ns = p.parse_args()
    forms = [f for f in FORMS if not ns.forms or f[0] in ns.forms.split(",")]
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = torch.empty(4 * sms * 512, dtype=torch.float32, device=dev)
    words = torch.randint(-2**31, 2**31 - 1, (WORDS * 512,), dtype=torch.int32, device=dev)
    results = []
    for per_sm in (int(v) for v in ns.per_sm.split(",")):
        grid = (sms * per_sm,)
        for form in forms:
            launch(form, grid, out, words, ns.iters)
            torch.cuda.synchronize()
            times = []
            for _ in range(3):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                launch(form, grid, out, words, ns.iters)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            us = min(times)
            weights = per_sm * ns.iters * WORDS * 8 * 128  # an SM's, in this launch
            key = f"{form[0]}:{form[1]}:sums{form[2]}:{per_sm}"
            results.append({"form": key, "iters": ns.iters, "us": round(us, 1),
                            "us_a_layer": round(LAYER_WEIGHTS_AN_SM * us / weights, 2)})
            print(results[-1], flush=True)
    write_results(ns.out, dev, results)


if __name__ == "__main__":
    main()
