"""The one-row 4-bit GEMV on tensor cores with every operand in registers (Gluon).

The packed-half GEMV spends ~30 instructions a 32-bit word (8 weights) on unpacking, scaling,
multiplying and summing; the tensor core can do the multiply-and-sum of 256 weights in one
instruction. Here each lane of a warp plays the part the 16x8x16 MMA gives it, and the layout
the weights already have (wna16.py: (K/8, N) words, value j of a word in bits 4j) is read so
that a lane's words land in the registers the MMA reads:

    C (16 channels, 8 columns) += A (16 channels, 16 inputs) . B (16 inputs, 8 columns)

- A (weights): lane 4g + t of a warp holds rows g and g + 8 and the inputs 2t, 2t+1, 2t+8,
  2t+9 of each 16-input step. A step here covers 4 word rows (32 inputs): lane t's row is
  word row 4s + t, and its word's nibble pairs (0,4), (1,5) feed the first MMA and (2,6), (3,7)
  the second, each pair becoming two 16-bit values with one shift and one lop3 (the nibble
  OR-ed into the mantissa of 128 for bf16, 1024 for fp16: exactly magic + q). A dot product
  does not care in which order its inputs are summed, so the MMA's input order is a permutation
  of K chosen to fit: inputs 8r + {0, 4, 1, 5} and 8r + {2, 6, 3, 7} of word row r.
- B (x): column g is x's row g (up to 8 rows; at one row every column is the same row), so
  each lane reads its row's 8 inputs of its word row (16 bytes) and two byte permutes make the
  same pairs. Lane 4g + t's four sums are then rows g and g + 8 (two channels) of columns 2t
  and 2t + 1 (two rows of x).
- The magic offset and the zero point come out once a group: the MMA sums
  sum_k (magic + q_k) x_k, a second MMA with all-ones weights sums sum_k x_k = X, and
  y += scale * (acc - (magic + zero) * X) once per 128 inputs (float32), X per row of x.

6-bit weights (the layout's second plane holds each value's two high bits, 16 values a word):
a lane also reads the second plane's words of its channels, and each pair takes its high bits
with one shift and one lop3 more (a byte permute a word spreads the word row's half first).

A lane reads 2V adjacent channels of its word row: V for the tile's rows g, V for rows g + 8,
so a warp covers 16V channels (V M-tiles) and a program WARPS warps side by side; each warp
runs the program's whole K range (CHUNKS groups of 128 inputs), the weights AHEAD steps ahead
of the MMAs and x X_AHEAD steps ahead (2, 4, 6 or 8 each). Split-K partials are combined as in
gemv.py (the last program of a column tile adds them in split order: deterministic). Gluon
kernels do not run on the Triton interpreter: CUDA only (sm_80+: the bf16 MMA), checked on the
GPU against the exact product, and its PTX and lane mapping on the CPU by an emulator
(tests/kernels/test_wna16_gemv_tc_ptx.py).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from peregrine.kernels._gluon import cta_barrier, pdl_release, pdl_wait


def _tile_asm(bf16: bool) -> str:
    """PTX: words $4 (rows g) and $5 (rows g + 8) as magic + q pairs, the two MMAs of a step
    with B pairs $6..$9 onto the sums $10..$13 (C's registers); out $0..$3."""
    magic = "0x43004300" if bf16 else "0x64006400"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{'bf16.bf16' if bf16 else 'f16.f16'}.f32"
    lines = ["{", ".reg .b32 l0, l1, l2, l3, h0, h1, h2, h3, t;"]
    for src, dst in (("$4", "l"), ("$5", "h")):
        lines.append(f"lop3.b32 {dst}0, {src}, 0x000F000F, {magic}, 0xEA;")
        for j in (1, 2, 3):
            lines.append(f"shr.u32 t, {src}, {4 * j};")
            lines.append(f"lop3.b32 {dst}{j}, t, 0x000F000F, {magic}, 0xEA;")
    lines.append(f"{mma} {{$0, $1, $2, $3}}, {{l0, h0, l1, h1}}, {{$6, $7}}, "
                 "{$10, $11, $12, $13};")
    lines.append(f"{mma} {{$0, $1, $2, $3}}, {{l2, h2, l3, h3}}, {{$8, $9}}, {{$0, $1, $2, $3}};")
    lines.append("}")
    return "\n".join(lines)


def _tile6_asm(bf16: bool) -> str:
    """PTX: 6-bit values, the low nibbles in words $4 (rows g) and $5 (rows g + 8), the high
    two bits in the second plane's words $6 and $7, whose half for this word row the byte
    selector $8 picks; otherwise as _tile_asm (B pairs $9..$12, sums $13..$16; out $0..$3).
    A pair (p, p + 4) takes its high bits from bits 2p and 16 + 2p of the picked half spread
    by prmt (values 0-3 in byte 0, 4-7 in byte 2), shifted to bits 4 and 20."""
    magic = "0x43004300" if bf16 else "0x64006400"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{'bf16.bf16' if bf16 else 'f16.f16'}.f32"
    lines = ["{", ".reg .b32 l0, l1, l2, l3, h0, h1, h2, h3, t, u, cl, ch, z;", "mov.b32 z, 0;",
             "prmt.b32 cl, $6, z, $8;", "prmt.b32 ch, $7, z, $8;"]
    for src, top, dst in (("$4", "cl", "l"), ("$5", "ch", "h")):
        for j in range(4):
            if j:
                lines.append(f"shr.u32 t, {src}, {4 * j};")
            lines.append(f"lop3.b32 {dst}{j}, {'t' if j else src}, 0x000F000F, {magic}, 0xEA;")
            shift = 4 - 2 * j
            if shift > 0:
                lines.append(f"shl.b32 u, {top}, {shift};")
            elif shift < 0:
                lines.append(f"shr.u32 u, {top}, {-shift};")
            lines.append(f"lop3.b32 {dst}{j}, {'u' if shift else top}, 0x00300030, {dst}{j}, "
                         "0xEA;")
    lines.append(f"{mma} {{$0, $1, $2, $3}}, {{l0, h0, l1, h1}}, {{$9, $10}}, "
                 "{$13, $14, $15, $16};")
    lines.append(f"{mma} {{$0, $1, $2, $3}}, {{l2, h2, l3, h3}}, {{$11, $12}}, "
                 "{$0, $1, $2, $3};")
    lines.append("}")
    return "\n".join(lines)


def _sum_asm(bf16: bool) -> str:
    """PTX: the step's input sum onto C's registers $9..$12 with all-ones weights ($4, four
    copies of 1.0 pairs) and B pairs $5..$8; out $0..$3."""
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{'bf16.bf16' if bf16 else 'f16.f16'}.f32"
    return "\n".join([
        "{",
        f"{mma} {{$0, $1, $2, $3}}, {{$4, $4, $4, $4}}, {{$5, $6}}, {{$9, $10, $11, $12}};",
        f"{mma} {{$0, $1, $2, $3}}, {{$4, $4, $4, $4}}, {{$7, $8}}, {{$0, $1, $2, $3}};", "}"])


_TILE_BF16 = gl.constexpr(_tile_asm(True))
_TILE_F16 = gl.constexpr(_tile_asm(False))
_TILE6_BF16 = gl.constexpr(_tile6_asm(True))
_TILE6_F16 = gl.constexpr(_tile6_asm(False))
_SUM_BF16 = gl.constexpr(_sum_asm(True))
_SUM_F16 = gl.constexpr(_sum_asm(False))
# x's words (x0 x1), (x2 x3), (x4 x5), (x6 x7) -> the B pairs (x0 x4), (x1 x5), (x2 x6), (x3 x7)
_PAIRS = gl.constexpr("prmt.b32 $0, $4, $6, 0x5410;\nprmt.b32 $1, $4, $6, 0x7632;\n"
                      "prmt.b32 $2, $5, $7, 0x5410;\nprmt.b32 $3, $5, $7, 0x7632;")
_LD4_NA = gl.constexpr("ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];")
_LD2_NA = gl.constexpr("ld.global.nc.L1::no_allocate.v2.b32 {$0, $1}, [$2];")
_LD1_NA = gl.constexpr("ld.global.nc.L1::no_allocate.b32 $0, [$1];")
_LD4 = gl.constexpr("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];")


@gluon.jit
def _ld_words(addr, NW: gl.constexpr, STREAM: gl.constexpr):
    """NW (4, 2 or 1) 32-bit words from the byte address addr (int64, NW*4-aligned), as a tuple
    of 4 (the missing ones repeat the first). STREAM: weights read once (no L1 line); else (x,
    16 bytes) an L1-cached load."""
    if NW == 4:
        if STREAM:
            r = gl.inline_asm_elementwise(_LD4_NA, "=r,=r,=r,=r,l", [addr],
                                          dtype=(gl.int32,) * 4, is_pure=False, pack=1)
        else:
            r = gl.inline_asm_elementwise(_LD4, "=r,=r,=r,=r,l", [addr],
                                          dtype=(gl.int32,) * 4, is_pure=False, pack=1)
        return r[0], r[1], r[2], r[3]
    elif NW == 2:
        r = gl.inline_asm_elementwise(_LD2_NA, "=r,=r,l", [addr], dtype=(gl.int32,) * 2,
                                      is_pure=False, pack=1)
        return r[0], r[1], r[0], r[0]
    else:
        r = gl.inline_asm_elementwise(_LD1_NA, "=r,l", [addr], dtype=gl.int32, is_pure=False,
                                      pack=1)
        return r, r, r, r


@gluon.jit
def _ld_step(wq, V: gl.constexpr):
    """A step's 2V words of the lane (a tuple of 8: V for rows g, then V for rows g + 8)."""
    if V == 4:
        a = _ld_words(wq, 4, True)
        b = _ld_words(wq + 16, 4, True)
        return a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]
    elif V == 2:
        a = _ld_words(wq, 4, True)
        return a[0], a[1], a[0], a[0], a[2], a[3], a[0], a[0]
    else:
        a = _ld_words(wq, 2, True)
        return a[0], a[0], a[0], a[0], a[1], a[0], a[0], a[0]


@gluon.jit
def _f32_lo(w, BF16: gl.constexpr):
    """The 16-bit float in w's low half, as float32."""
    if BF16:
        return (w << 16).to(gl.float32, bitcast=True)
    else:
        return (w & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)


@gluon.jit
def _f32_hi(w, BF16: gl.constexpr):
    """The 16-bit float in w's high half, as float32."""
    if BF16:
        return (w & -65536).to(gl.float32, bitcast=True)
    else:
        return (w >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)


@gluon.jit
def _bits16(v, BF16: gl.constexpr):
    """float32 v rounded to the 16-bit dtype, its bits in the low half of an int32."""
    if BF16:
        return v.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    else:
        return v.to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF


@gluon.jit
def _silu_mul(g, u):
    """silu(g) * u in float32 (the expression of kernels/activation.py)."""
    return g / (1.0 + gl.exp(-g)) * u


@gluon.jit
def _ld_x(xa, K2, GATED: gl.constexpr, BF16: gl.constexpr):
    """The B pairs of the lane's word row: its inputs x0..x7 (16 bytes at xa) as (x0 x4),
    (x1 x5), (x2 x6), (x3 x7). GATED: x = silu(gate) * up rounded to the dtype, gate at xa and
    up K2 bytes on."""
    x = _ld_words(xa, 4, False)
    if GATED:
        u = _ld_words(xa + K2, 4, False)
        v0 = _bits16(_silu_mul(_f32_lo(x[0], BF16), _f32_lo(u[0], BF16)), BF16)
        v1 = _bits16(_silu_mul(_f32_hi(x[0], BF16), _f32_hi(u[0], BF16)), BF16)
        v2 = _bits16(_silu_mul(_f32_lo(x[1], BF16), _f32_lo(u[1], BF16)), BF16)
        v3 = _bits16(_silu_mul(_f32_hi(x[1], BF16), _f32_hi(u[1], BF16)), BF16)
        v4 = _bits16(_silu_mul(_f32_lo(x[2], BF16), _f32_lo(u[2], BF16)), BF16)
        v5 = _bits16(_silu_mul(_f32_hi(x[2], BF16), _f32_hi(u[2], BF16)), BF16)
        v6 = _bits16(_silu_mul(_f32_lo(x[3], BF16), _f32_lo(u[3], BF16)), BF16)
        v7 = _bits16(_silu_mul(_f32_hi(x[3], BF16), _f32_hi(u[3], BF16)), BF16)
        return v0 | (v4 << 16), v1 | (v5 << 16), v2 | (v6 << 16), v3 | (v7 << 16)
    r = gl.inline_asm_elementwise(_PAIRS, "=r,=r,=r,=r,r,r,r,r", [x[0], x[1], x[2], x[3]],
                                  dtype=(gl.int32,) * 4, is_pure=True, pack=1)
    return r[0], r[1], r[2], r[3]


@gluon.jit
def _tile(lo, hi, b, c, BF16: gl.constexpr):
    """An M-tile's two MMAs of a step: C's four registers c onto the words lo, hi."""
    if BF16:
        r = gl.inline_asm_elementwise(_TILE_BF16, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                                      [lo, hi, b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3]],
                                      dtype=(gl.float32,) * 4, is_pure=True, pack=1)
    else:
        r = gl.inline_asm_elementwise(_TILE_F16, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                                      [lo, hi, b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3]],
                                      dtype=(gl.float32,) * 4, is_pure=True, pack=1)
    return r[0], r[1], r[2], r[3]


@gluon.jit
def _tile6(lo, hi, plo, phi, sel, b, c, BF16: gl.constexpr):
    """_tile for 6-bit values: plo, phi the second plane's words, sel the lane's half."""
    if BF16:
        r = gl.inline_asm_elementwise(
            _TILE6_BF16, "=f,=f,=f,=f,r,r,r,r,r,r,r,r,r,f,f,f,f",
            [lo, hi, plo, phi, sel, b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3]],
            dtype=(gl.float32,) * 4, is_pure=True, pack=1)
    else:
        r = gl.inline_asm_elementwise(
            _TILE6_F16, "=f,=f,=f,=f,r,r,r,r,r,r,r,r,r,f,f,f,f",
            [lo, hi, plo, phi, sel, b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3]],
            dtype=(gl.float32,) * 4, is_pure=True, pack=1)
    return r[0], r[1], r[2], r[3]


@gluon.jit
def _tiles(w, i: gl.constexpr, b, c, sel, BITS: gl.constexpr, BF16: gl.constexpr):
    """M-tile i's step: its words (rows g: slot i, rows g + 8: slot 4 + i) of the step's item w
    (4 bits: the 8 slots; 6 bits: (the slots, the second plane's slots))."""
    if BITS == 6:
        r = _tile6(w[0][i], w[0][4 + i], w[1][i], w[1][4 + i], sel, b, c, BF16)
    else:
        r = _tile(w[i], w[4 + i], b, c, BF16)
    return r


@gluon.jit
def _step(acc, cx, ones, w, b, sel, V: gl.constexpr, BF16: gl.constexpr, BITS: gl.constexpr):
    """One step's MMAs: acc (V M-tiles' C registers, 4 each; a tuple of 4) and cx (the input
    sum's) onto the words w (8: rows g of M-tiles 0..3, then rows g + 8) and B pairs b (4)."""
    a0 = _tiles(w, 0, b, acc[0], sel, BITS, BF16)
    a1 = acc[1]
    a2 = acc[2]
    a3 = acc[3]
    if V >= 2:
        a1 = _tiles(w, 1, b, acc[1], sel, BITS, BF16)
    if V == 4:
        a2 = _tiles(w, 2, b, acc[2], sel, BITS, BF16)
        a3 = _tiles(w, 3, b, acc[3], sel, BITS, BF16)
    if BF16:
        r = gl.inline_asm_elementwise(_SUM_BF16, "=f,=f,=f,=f,r,r,r,r,r,f,f,f,f",
                                      [ones, b[0], b[1], b[2], b[3], cx[0], cx[1], cx[2], cx[3]],
                                      dtype=(gl.float32,) * 4, is_pure=True, pack=1)
    else:
        r = gl.inline_asm_elementwise(_SUM_F16, "=f,=f,=f,=f,r,r,r,r,r,f,f,f,f",
                                      [ones, b[0], b[1], b[2], b[3], cx[0], cx[1], cx[2], cx[3]],
                                      dtype=(gl.float32,) * 4, is_pure=True, pack=1)
    return (a0, a1, a2, a3), (r[0], r[1], r[2], r[3])


@gluon.jit
def _ld_group(sa, za, V: gl.constexpr, HAS_ZP: gl.constexpr):
    """The lane's 2V scales (and zero points) of a group as 16-bit pairs (a tuple of 4)."""
    NW: gl.constexpr = V  # 2V 16-bit values
    s = _ld_words(sa, NW, True)
    if HAS_ZP:
        z = _ld_words(za, NW, True)
    else:
        z = s
    return s, z


@gluon.jit
def _channel(words, j: gl.constexpr, BF16: gl.constexpr):
    """Channel j's 16-bit value of the lane's pairs (channel 2i in word i's low half)."""
    if j % 2 == 0:
        return _f32_lo(words[j // 2], BF16)
    else:
        return _f32_hi(words[j // 2], BF16)


@gluon.jit
def _fix(y, a, x_sum, s_words, z_words, j: gl.constexpr, HAS_ZP: gl.constexpr,
         BF16: gl.constexpr, MAGIC: gl.constexpr, HALF: gl.constexpr):
    s = _channel(s_words, j, BF16)
    if HAS_ZP:
        zc = _channel(z_words, j, BF16) + MAGIC
    else:
        zc = MAGIC + HALF
    return y + s * (a - zc * x_sum)


@gluon.jit
def _group_done(y, acc, cx, sz, R: gl.constexpr, V: gl.constexpr, HAS_ZP: gl.constexpr,
                BF16: gl.constexpr, BITS: gl.constexpr):
    """y (8 float32 sums of x's row 2t + R: channels of rows g of M-tiles 0..3, then rows g + 8)
    plus a group's scaled sums, the magic + zero point taken out: C's register R (column 2t + R)
    of rows g, register 2 + R of rows g + 8, and the input sum's register R."""
    MAGIC: gl.constexpr = 128.0 if BF16 else 1024.0
    HALF: gl.constexpr = 32.0 if BITS == 6 else 8.0  # the zero point without one
    s_w, z_w = sz
    xs = cx[R]
    y0 = _fix(y[0], acc[0][R], xs, s_w, z_w, 0, HAS_ZP, BF16, MAGIC, HALF)
    y4 = _fix(y[4], acc[0][2 + R], xs, s_w, z_w, V, HAS_ZP, BF16, MAGIC, HALF)
    y1, y2, y3, y5, y6, y7 = y[1], y[2], y[3], y[5], y[6], y[7]
    if V >= 2:
        y1 = _fix(y[1], acc[1][R], xs, s_w, z_w, 1, HAS_ZP, BF16, MAGIC, HALF)
        y5 = _fix(y[5], acc[1][2 + R], xs, s_w, z_w, V + 1, HAS_ZP, BF16, MAGIC, HALF)
    if V == 4:
        y2 = _fix(y[2], acc[2][R], xs, s_w, z_w, 2, HAS_ZP, BF16, MAGIC, HALF)
        y3 = _fix(y[3], acc[3][R], xs, s_w, z_w, 3, HAS_ZP, BF16, MAGIC, HALF)
        y6 = _fix(y[6], acc[2][2 + R], xs, s_w, z_w, 6, HAS_ZP, BF16, MAGIC, HALF)
        y7 = _fix(y[7], acc[3][2 + R], xs, s_w, z_w, 7, HAS_ZP, BF16, MAGIC, HALF)
    return y0, y1, y2, y3, y4, y5, y6, y7


@gluon.jit
def _store(ptr, n_lane, y, ok, V: gl.constexpr, OUT_16: gl.constexpr):
    """The lane's 2V sums to channels n_lane + i (rows g) and n_lane + V + i (rows g + 8)."""
    if OUT_16:
        gl.store(ptr + n_lane, y[0].to(ptr.dtype.element_ty), mask=ok)
        gl.store(ptr + (n_lane + V), y[4].to(ptr.dtype.element_ty), mask=ok)
        if V >= 2:
            gl.store(ptr + (n_lane + 1), y[1].to(ptr.dtype.element_ty), mask=ok)
            gl.store(ptr + (n_lane + V + 1), y[5].to(ptr.dtype.element_ty), mask=ok)
        if V == 4:
            gl.store(ptr + (n_lane + 2), y[2].to(ptr.dtype.element_ty), mask=ok)
            gl.store(ptr + (n_lane + 3), y[3].to(ptr.dtype.element_ty), mask=ok)
            gl.store(ptr + (n_lane + 6), y[6].to(ptr.dtype.element_ty), mask=ok)
            gl.store(ptr + (n_lane + 7), y[7].to(ptr.dtype.element_ty), mask=ok)
    else:
        gl.store(ptr + n_lane, y[0], mask=ok)
        gl.store(ptr + (n_lane + V), y[4], mask=ok)
        if V >= 2:
            gl.store(ptr + (n_lane + 1), y[1], mask=ok)
            gl.store(ptr + (n_lane + V + 1), y[5], mask=ok)
        if V == 4:
            gl.store(ptr + (n_lane + 2), y[2], mask=ok)
            gl.store(ptr + (n_lane + 3), y[3], mask=ok)
            gl.store(ptr + (n_lane + 6), y[6], mask=ok)
            gl.store(ptr + (n_lane + 7), y[7], mask=ok)


@gluon.jit
def _store_rows(y, y_odd, n_lane, n_ok, t, M, N, split, pid_n, part_ptr, lock_ptr, c_ptr, SPLIT_K,
                V: gl.constexpr, WARPS: gl.constexpr, ROWS: gl.constexpr,
                HAS_SPLIT: gl.constexpr):
    """The tensor-core GEMVs' epilogue: lane 4g + t's sums of rows 2t (y) and 2t + 1 (y_odd; at
    ROWS 1 every lane holds row 0's and t == 0 stores them) into the output, or into this
    split's partials, the last program of the column tile then adding them in split order."""
    T: gl.constexpr = 32 * WARPS
    if ROWS == 1:  # every lane 4g + t holds row 0's sums: t == 0 stores them
        n_rows = 1
        row = 0
        ok_even = n_ok & (t == 0)
        ok_odd = ok_even
    else:  # lane 4g + t holds rows 2t and 2t + 1
        n_rows = M
        row = 2 * t
        ok_even = n_ok & (row < M)
        ok_odd = n_ok & (row + 1 < M)
    if HAS_SPLIT:
        base = part_ptr + (split * n_rows).to(gl.int64) * N
        _store(base + row * N, n_lane, y, ok_even, V, False)
        if ROWS > 1:
            _store(base + (row + 1).to(gl.int64) * N, n_lane, y_odd, ok_odd, V, False)
        # NOTE: every thread's partial stores are issued before the ticket (barrier), and the
        # ticket is a gpu-scope acq_rel atomic, so the last program sees all partials (read
        # from L2, never a stale L1 line).
        cta_barrier()
        ticket = gl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            TILE: gl.constexpr = WARPS * 16 * V
            PER: gl.constexpr = (TILE + T - 1) // T
            LC: gl.constexpr = gl.BlockedLayout([PER], [32], [WARPS], [0])
            offs_n = pid_n * TILE + gl.arange(0, TILE, layout=LC)
            n_mask = offs_n < N
            for m in range(n_rows):
                total = gl.zeros([TILE], gl.float32, layout=LC)
                for s0 in range(0, SPLIT_K, 4):  # four partials' loads in flight, in order
                    r0 = (s0 * n_rows + m) * N + offs_n
                    q0 = gl.load(part_ptr + r0, mask=n_mask, other=0.0, cache_modifier=".cg")
                    q1 = gl.load(part_ptr + (r0 + n_rows * N), mask=n_mask & (s0 + 1 < SPLIT_K),
                                 other=0.0, cache_modifier=".cg")
                    q2 = gl.load(part_ptr + (r0 + 2 * n_rows * N),
                                 mask=n_mask & (s0 + 2 < SPLIT_K), other=0.0, cache_modifier=".cg")
                    q3 = gl.load(part_ptr + (r0 + 3 * n_rows * N),
                                 mask=n_mask & (s0 + 3 < SPLIT_K), other=0.0, cache_modifier=".cg")
                    total += q0
                    total += q1
                    total += q2
                    total += q3
                gl.store(c_ptr + m * N + offs_n, total.to(c_ptr.dtype.element_ty), mask=n_mask)
            gl.atomic_xchg(lock_ptr + pid_n, 0)
    else:
        _store(c_ptr + row * N, n_lane, y, ok_even, V, True)
        if ROWS > 1:
            _store(c_ptr + (row + 1).to(gl.int64) * N, n_lane, y_odd, ok_odd, V, True)


@gluon.jit
def _push(q, item, N: gl.constexpr):
    """The queue q (a tuple of N) without its first item, item appended."""
    if N == 2:
        return q[1], item
    elif N == 4:
        return q[1], q[2], q[3], item
    elif N == 6:
        return q[1], q[2], q[3], q[4], q[5], item
    else:
        return q[1], q[2], q[3], q[4], q[5], q[6], q[7], item


@gluon.jit
def _ld_item(wq, hq, V: gl.constexpr, BITS: gl.constexpr):
    """A step's words (6 bits: and the second plane's, as a pair of tuples)."""
    if BITS == 6:
        r = (_ld_step(wq, V), _ld_step(hq, V))
    else:
        r = _ld_step(wq, V)
    return r


@gluon.jit
def _ld_queue(wq, wq_step, hq, hq_step, last, N: gl.constexpr, V: gl.constexpr,
              BITS: gl.constexpr):
    """Steps 0..N-1's items (2, 4, 6 or 8 steps; past the last step the last again)."""
    q0 = _ld_item(wq, hq, V, BITS)
    i1 = gl.minimum(1, last)
    q1 = _ld_item(wq + i1 * wq_step, hq + i1 * hq_step, V, BITS)
    if N == 2:
        r = (q0, q1)
    else:
        i2 = gl.minimum(2, last)
        i3 = gl.minimum(3, last)
        q2 = _ld_item(wq + i2 * wq_step, hq + i2 * hq_step, V, BITS)
        q3 = _ld_item(wq + i3 * wq_step, hq + i3 * hq_step, V, BITS)
        if N == 4:
            r = (q0, q1, q2, q3)
        else:
            i4 = gl.minimum(4, last)
            i5 = gl.minimum(5, last)
            q4 = _ld_item(wq + i4 * wq_step, hq + i4 * hq_step, V, BITS)
            q5 = _ld_item(wq + i5 * wq_step, hq + i5 * hq_step, V, BITS)
            if N == 6:
                r = (q0, q1, q2, q3, q4, q5)
            else:
                i6 = gl.minimum(6, last)
                i7 = gl.minimum(7, last)
                q6 = _ld_item(wq + i6 * wq_step, hq + i6 * hq_step, V, BITS)
                q7 = _ld_item(wq + i7 * wq_step, hq + i7 * hq_step, V, BITS)
                r = (q0, q1, q2, q3, q4, q5, q6, q7)
    return r


@gluon.jit
def _ld_x_queue(xa, K2, last, N: gl.constexpr, GATED: gl.constexpr, BF16: gl.constexpr):
    """Steps 0..N-1's B pairs, as _ld_queue."""
    q0 = _ld_x(xa, K2, GATED, BF16)
    q1 = _ld_x(xa + gl.minimum(1, last) * 64, K2, GATED, BF16)
    if N == 2:
        r = (q0, q1)
    else:
        q2 = _ld_x(xa + gl.minimum(2, last) * 64, K2, GATED, BF16)
        q3 = _ld_x(xa + gl.minimum(3, last) * 64, K2, GATED, BF16)
        if N == 4:
            r = (q0, q1, q2, q3)
        else:
            q4 = _ld_x(xa + gl.minimum(4, last) * 64, K2, GATED, BF16)
            q5 = _ld_x(xa + gl.minimum(5, last) * 64, K2, GATED, BF16)
            if N == 6:
                r = (q0, q1, q2, q3, q4, q5)
            else:
                q6 = _ld_x(xa + gl.minimum(6, last) * 64, K2, GATED, BF16)
                q7 = _ld_x(xa + gl.minimum(7, last) * 64, K2, GATED, BF16)
                r = (q0, q1, q2, q3, q4, q5, q6, q7)
    return r


@gluon.jit(do_not_specialize=["M", "stride_am", "SPLIT_K", "CHUNKS"])
def wna16_gemv_tc_kernel(
    a_ptr, q_ptr, qhi_ptr, s_ptr, z_ptr, part_ptr, lock_ptr, c_ptr,
    M, N, K, stride_am, SPLIT_K, CHUNKS,
    GROUP: gl.constexpr, HAS_ZP: gl.constexpr, GATED: gl.constexpr, V: gl.constexpr,
    WARPS: gl.constexpr, HAS_SPLIT: gl.constexpr, BF16: gl.constexpr, PDL: gl.constexpr,
    AHEAD: gl.constexpr = 2, X_AHEAD: gl.constexpr = 2, ROWS: gl.constexpr = 1,
    BITS: gl.constexpr = 4,
):
    """y (M, N) of M <= ROWS <= 8 rows x (M, K) (GATED: h (M, 2K)), rows stride_am apart, and
    4-bit (or 6-bit: and the second plane's (K/16, N) words at qhi_ptr) weights in wna16.py's
    layout (K/8, N) words, (K/GROUP, N) scales and zero points; the
    output and the partials (split, M, N) are contiguous. B's column g is x's row g (the last row
    again past M); lane 4g + t then holds C's columns 2t and 2t + 1: rows 2t and 2t + 1's sums.
    Program (tile, split) covers WARPS * 16V channels and the CHUNKS groups of 128 inputs from
    split * CHUNKS * 128; N is a multiple of 2V (the lane's channels are all there or all past
    N)."""
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
    word0 = split * (CHUNKS * 16) + t  # the lane's word row at step 0
    # byte addresses at step 0 / group 0 and their strides
    q_base = q_ptr.to(gl.int64)
    wq = q_base + (word0.to(gl.int64) * N + n_ld) * 4
    wq_step = (16 * N).to(gl.int64)  # 4 word rows
    # 6 bits: the second plane's word row word // 2 (2 a step), its half word % 2 == t % 2
    hq = qhi_ptr.to(gl.int64) + ((word0 // 2).to(gl.int64) * N + n_ld) * 4
    hq_step = (8 * N).to(gl.int64)
    sel = gl.where(t % 2 == 0, 0x4140, 0x4342)
    xa = a_ptr.to(gl.int64) + word0.to(gl.int64) * 16  # ROWS == 1: every column is row 0
    if ROWS > 1:  # B's column g: x's row g, the last row again past M
        xa += gl.minimum(g, M - 1).to(gl.int64) * stride_am * 2
    K2 = K * 2
    grp0 = (split * CHUNKS * 128) // GROUP
    sa = s_ptr.to(gl.int64) + ((grp0 * N).to(gl.int64) + n_ld) * 2
    za = z_ptr.to(gl.int64) + ((grp0 * N).to(gl.int64) + n_ld) * 2
    g_step = (N * 2).to(gl.int64)
    STEPS_PER_GROUP: gl.constexpr = 4
    last = CHUNKS * STEPS_PER_GROUP - 1

    # the first AHEAD steps' weights and the first group's scales (constant) are issued before
    # the wait in the source; ptxas places the wait above these read-only (.nc) loads (loads
    # through the coherent path stay above it, and measured slower: see the benchmarks)
    wq_q = _ld_queue(wq, wq_step, hq, hq_step, last, AHEAD, V, BITS)
    sz_n = _ld_group(sa, za, V, HAS_ZP)
    pdl_wait(PDL)
    x_q = _ld_x_queue(xa, K2, last, X_AHEAD, GATED, BF16)
    zero = gl.zeros([T], gl.float32, layout=L)
    ones = gl.full([T], 0x3F803F80 if BF16 else 0x3C003C00, gl.int32, layout=L)  # 1.0 pairs
    y = (zero, zero, zero, zero, zero, zero, zero, zero)  # rows 2t
    y_odd = y  # rows 2t + 1 (ROWS > 1)
    for c in range(CHUNKS):
        sz = sz_n
        # the next group's scales (this one's again at the end)
        gn = ((split * CHUNKS + gl.minimum(c + 1, CHUNKS - 1)) * 128) // GROUP - grp0
        sz_n = _ld_group(sa + gn * g_step, za + gn * g_step, V, HAS_ZP)
        c4 = (zero, zero, zero, zero)
        acc = (c4, c4, c4, c4)
        cx = c4
        for s in gl.static_range(STEPS_PER_GROUP):
            # NOTE: queues of AHEAD steps' words and X_AHEAD steps' inputs in registers: the
            # oldest is computed, the step AHEAD (X_AHEAD) on is loaded (past the last one the
            # last again, from L2).
            nxt = gl.minimum(c * STEPS_PER_GROUP + s + AHEAD, last)
            x_nxt = gl.minimum(c * STEPS_PER_GROUP + s + X_AHEAD, last)
            w_c = wq_q[0]
            x_c = x_q[0]
            wq_q = _push(wq_q, _ld_item(wq + nxt * wq_step, hq + nxt * hq_step, V, BITS), AHEAD)
            x_q = _push(x_q, _ld_x(xa + x_nxt * 64, K2, GATED, BF16), X_AHEAD)
            acc, cx = _step(acc, cx, ones, w_c, x_c, sel, V, BF16, BITS)
        y = _group_done(y, acc, cx, sz, 0, V, HAS_ZP, BF16, BITS)
        if ROWS > 1:
            y_odd = _group_done(y_odd, acc, cx, sz, 1, V, HAS_ZP, BF16, BITS)
    pdl_release(PDL)
    _store_rows(y, y_odd, n_lane, n_ok, t, M, N, split, pid_n, part_ptr, lock_ptr, c_ptr, SPLIT_K,
                V, WARPS, ROWS, HAS_SPLIT)
