"""The one-row int4 tensor-core GEMV's work on a TMA ring's chunks (Gluon, sm_90+), as the
persistent decode kernel (decode_layers.py) runs it in its projection phases.

A projection's weight is cut into (tile of 32 channels a consumer warp, group of 128 inputs)
units, tile-major (`tile_words`: each unit 16 rows of the layout's own words, value j of a word
in bits 4j, in the order the lanes read them; `tile_scales`: each unit's scales and zero points
in one row, four words a quad of channels), shared out evenly over the programs (`share`,
stream-K). A program's consumer warps take a unit's chunk from the ring as it lands and do the
tc kernel's per-lane arithmetic on it (wna16_gemv_tc.py: each lane's words read into the
registers its MMAs take them from, one `ld.shared.v4` a lane a step; the zero point and scale
once a group), x read through L2 four or eight steps ahead, or (`_x_to_smem`, `_x_smem`) from
a shared-memory copy of it made once a phase by cp.async, so that no step waits on a round trip
to L2 (which the weight stream's TMA traffic makes long); a piece of a tile stores its float32
partials, which `_tile_sum` adds in piece order.

A form on fp16 operands (F16, with x in shared memory) spends fewer instructions a step: x's
copy is rewritten once a phase as the B pairs in fp16 (no byte permutes a step), and each word
decodes with one shift and four lop3 instead of three and four, the values at bits 4-7 of a
half word taken as they lie against a magic of 64 (`_tile_f16_asm`). bf16 inputs are exact in
fp16 between 2^-14 and 65504 (the models' activations; beyond, the largest finite value).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from peregrine.kernels._gluon import cp_async, cta_barrier, smem_reinterpret
from peregrine.kernels.wna16_gemv_tc import (_PAIRS, _channel, _group_done, _ld_group, _push,
                                             _step, _store, _tiles)

V = gl.constexpr(2)  # a lane's channels per M-tile pair: 32 a warp


def _tile_f16_asm() -> str:
    """PTX of a step's two MMAs on fp16 operands: a word's value j (bits 4j) as an fp16 pair
    with one lop3 and no shift where it can: the values at bits 0-3 (and 16-19) OR-ed into 1024
    (0x6400: mantissa bit 0 weighs 1), those at bits 4-7 (and 20-23) into 64 (0x5400: mantissa
    bit 4 weighs 1), so (0, 4), (1, 5) from the word and (2, 6), (3, 7) from it shifted by 8:
    exactly magic + q, in the tc kernel's pair order. Words $4 (rows g), $5 (rows g + 8), B
    pairs $6..$9, sums $10..$13; out $0..$3."""
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
    lines = ["{", ".reg .b32 l0, l1, l2, l3, h0, h1, h2, h3, t;"]
    for src, dst in (("$4", "l"), ("$5", "h")):
        lines += [f"lop3.b32 {dst}0, {src}, 0x000F000F, 0x64006400, 0xEA;",
                  f"lop3.b32 {dst}1, {src}, 0x00F000F0, 0x54005400, 0xEA;",
                  f"shr.u32 t, {src}, 8;",
                  f"lop3.b32 {dst}2, t, 0x000F000F, 0x64006400, 0xEA;",
                  f"lop3.b32 {dst}3, t, 0x00F000F0, 0x54005400, 0xEA;"]
    lines += [f"{mma} {{$0, $1, $2, $3}}, {{l0, h0, l1, h1}}, {{$6, $7}}, {{$10, $11, $12, $13}};",
              f"{mma} {{$0, $1, $2, $3}}, {{l2, h2, l3, h3}}, {{$8, $9}}, {{$0, $1, $2, $3}};",
              "}"]
    return "\n".join(lines)


def _sum_f16_asm() -> str:
    """PTX: a step's magic-weighted and plain input sums onto C's registers $8..$11 with
    constant weights (rows 0-7: the pairs' magics, 1024 for A registers 0 and 1, 64 for 2 and
    3; rows 8-15: ones) and B pairs $4..$7: rows g give sum(magic_k x_k), rows g + 8 sum(x_k);
    out $0..$3."""
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
    return "\n".join([
        "{", ".reg .b32 m, n, o;", "mov.b32 m, 0x64006400;", "mov.b32 n, 0x54005400;",
        "mov.b32 o, 0x3C003C00;",
        f"{mma} {{$0, $1, $2, $3}}, {{m, o, n, o}}, {{$4, $5}}, {{$8, $9, $10, $11}};",
        f"{mma} {{$0, $1, $2, $3}}, {{m, o, n, o}}, {{$6, $7}}, {{$0, $1, $2, $3}};", "}"])


# a row of x's 8 bf16 inputs (x0 x1) (x2 x3) (x4 x5) (x6 x7) -> the fp16 B pairs (x0 x4),
# (x1 x5), (x2 x6), (x3 x7) (beyond fp16's range: its largest finite value)
_F16_PAIRS = gl.constexpr(
    "{\n.reg .b32 a0, a1, a2, a3, a4, a5, a6, a7;\n"
    "shl.b32 a0, $4, 16;\nand.b32 a1, $4, 0xFFFF0000;\nshl.b32 a2, $5, 16;\n"
    "and.b32 a3, $5, 0xFFFF0000;\nshl.b32 a4, $6, 16;\nand.b32 a5, $6, 0xFFFF0000;\n"
    "shl.b32 a6, $7, 16;\nand.b32 a7, $7, 0xFFFF0000;\n"
    "cvt.rn.satfinite.f16x2.f32 $0, a4, a0;\ncvt.rn.satfinite.f16x2.f32 $1, a5, a1;\n"
    "cvt.rn.satfinite.f16x2.f32 $2, a6, a2;\ncvt.rn.satfinite.f16x2.f32 $3, a7, a3;\n}")
_TILE_F16 = gl.constexpr(_tile_f16_asm())
_SUM_F16 = gl.constexpr(_sum_f16_asm())


@gluon.jit
def _tile_f16(lo, hi, b, c):
    r = gl.inline_asm_elementwise(_TILE_F16, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                                  [lo, hi, b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3]],
                                  dtype=(gl.float32,) * 4, is_pure=True, pack=1)
    return r[0], r[1], r[2], r[3]


@gluon.jit
def _step_f16(acc, cx, w, b):
    """_step on fp16 operands (_tile_f16_asm): the two M-tiles' words w (the V = 2 tuple), B
    pairs b; cx: the magic-weighted sums (C registers 0, 1) and the plain ones (2, 3)."""
    a0 = _tile_f16(w[0], w[4], b, acc[0])
    a1 = _tile_f16(w[1], w[5], b, acc[1])
    r = gl.inline_asm_elementwise(_SUM_F16, "=f,=f,=f,=f,r,r,r,r,f,f,f,f",
                                  [b[0], b[1], b[2], b[3], cx[0], cx[1], cx[2], cx[3]],
                                  dtype=(gl.float32,) * 4, is_pure=True, pack=1)
    return (a0, a1, acc[2], acc[3]), (r[0], r[1], r[2], r[3])


@gluon.jit
def _group_done_f16(y, acc, cx, sz):
    """_group_done for _step_f16's sums: y + scale * (acc - sum(magic_k x_k) - zero * sum(x)),
    channel by channel (the lane's rows g of M-tiles 0, 1, then rows g + 8; x's row 2t)."""
    s_w, z_w = sz
    m = cx[0]
    xs = cx[2]
    y0 = y[0] + _channel(s_w, 0, True) * (acc[0][0] - m - _channel(z_w, 0, True) * xs)
    y1 = y[1] + _channel(s_w, 1, True) * (acc[1][0] - m - _channel(z_w, 1, True) * xs)
    y4 = y[4] + _channel(s_w, 2, True) * (acc[0][2] - m - _channel(z_w, 2, True) * xs)
    y5 = y[5] + _channel(s_w, 3, True) * (acc[1][2] - m - _channel(z_w, 3, True) * xs)
    return y0, y1, y[2], y[3], y4, y5, y[6], y[7]


@gluon.jit
def _words(buf, row: gl.constexpr, LW: gl.constexpr, L: gl.constexpr, T: gl.constexpr):
    """A step's words of every lane from the chunk buf (in tile_words' order, the step's 4 word
    rows at rows `row` .. + 3): lane 4g + t of warp w reads the 16 bytes at 16 (32w + 4g + t)
    of them, word row `row + t`'s channels 32w + 4g .. + 3, as the tc kernel's V = 2 step tuple
    (LW: word_layout; the reshapes only relabel registers: one ld.shared.v4 a lane, a warp's
    512 contiguous bytes, free of bank conflicts)."""
    w = buf.slice(row, 4, dim=0).load(LW)
    a, b = gl.split(gl.reshape(w, [T, 2, 2]))
    e0, e2 = gl.split(a)
    e1, e3 = gl.split(b)
    e0 = gl.convert_layout(e0, L)
    e1 = gl.convert_layout(e1, L)
    e2 = gl.convert_layout(e2, L)
    e3 = gl.convert_layout(e3, L)
    return e0, e1, e0, e0, e2, e3, e0, e0


@gluon.jit
def _share(pid, W, total):
    start = gl.minimum(pid * W, total)
    return start, gl.minimum(start + W, total)


@gluon.jit
def _add4(a, b):
    return a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]


@gluon.jit
def _ld_x(xa):
    """The B pairs of the lane's word row (16 bytes of x at xa) read through L2: x was written
    by another program of this kernel."""
    r = gl.inline_asm_elementwise("ld.global.cg.v4.b32 {$0, $1, $2, $3}, [$4];",
                                  "=r,=r,=r,=r,l", [xa], dtype=(gl.int32,) * 4, is_pure=False,
                                  pack=1)
    p = gl.inline_asm_elementwise(_PAIRS, "=r,=r,=r,=r,r,r,r,r", [r[0], r[1], r[2], r[3]],
                                  dtype=(gl.int32,) * 4, is_pure=True, pack=1)
    return p[0], p[1], p[2], p[3]


@gluon.jit
def _x_queue(xa, last, N: gl.constexpr):
    """Steps 0 .. N - 1's B pairs (4 or 8 steps; past the last step the last again)."""
    q0 = _ld_x(xa)
    q1 = _ld_x(xa + gl.minimum(1, last) * 64)
    q2 = _ld_x(xa + gl.minimum(2, last) * 64)
    q3 = _ld_x(xa + gl.minimum(3, last) * 64)
    if N == 4:
        r = (q0, q1, q2, q3)
    else:
        q4 = _ld_x(xa + gl.minimum(4, last) * 64)
        q5 = _ld_x(xa + gl.minimum(5, last) * 64)
        q6 = _ld_x(xa + gl.minimum(6, last) * 64)
        q7 = _ld_x(xa + gl.minimum(7, last) * 64)
        r = (q0, q1, q2, q3, q4, q5, q6, q7)
    return r


def x_groups(k_max: int, tile: int) -> int:
    """Groups of 128 inputs the shared-memory copy of x holds: the widest projection's, a power
    of two, at least a tile's rows (16 a group) so that the copy's blocks are whole."""
    g = max(-(-k_max // 128), tile // 16)
    return 1 << (g - 1).bit_length()


@gluon.jit
def _x_to_smem(xs, x_ptr, x_off, CHUNKS, T: gl.constexpr, WARPS: gl.constexpr,
               F16: gl.constexpr = False, xsb=None, bs_ptr=None, XSUM: gl.constexpr = 0,
               XP: gl.constexpr = False):
    """x (CHUNKS groups of 128 bf16 at element x_off of x_ptr, 16-byte aligned) into xs ((groups,
    16, 4) int32: a group's 16 rows of 8 inputs) by cp.async, a 16-byte row a thread a block of
    T rows, all in flight at once; returns when every warp's copies have landed (F16: and each
    row has been rewritten in place as its fp16 B pairs, _F16_PAIRS; XP: as its bf16 B pairs,
    _PAIRS, so that no MMA step rearranges them; XSUM: each group's input sum, its two blocks'
    at bs_ptr + x_off / 64, into xsb, (groups, 1, 2) float32)."""
    LC: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [WARPS, 1], [1, 0])
    blocks = smem_reinterpret(xs, gl.int32, [xs.shape[0] * 16 // T, T, 4],
                              gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    r = gl.arange(0, T, layout=gl.SliceLayout(1, LC))
    w = gl.arange(0, 4, layout=gl.SliceLayout(0, LC))
    off = gl.expand_dims(r, 1) * 4 + gl.expand_dims(w, 0)
    src = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + gl.multiple_of(x_off // 2, 4)
    for b in range(0, (CHUNKS * 16 + T - 1) // T):
        ok = gl.expand_dims(b * T + r < CHUNKS * 16, 1)
        cp_async(blocks.index(b), src + b * (T * 4) + off, mask=ok, cache_modifier=".cg")
    async_copy.commit_group()
    if XSUM:  # (its round trip beside the copy's)
        LB: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [WARPS, 1], [1, 0])
        NG: gl.constexpr = xsb.shape[0]
        gb = gl.expand_dims(gl.arange(0, NG, layout=gl.SliceLayout(1, LB)), 1)
        hb = gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, LB)), 0)
        sums = gl.load(bs_ptr + x_off // 64 + gb * 2 + hb, mask=gb < CHUNKS, other=0.0,
                       cache_modifier=".cg")
        smem_reinterpret(xsb, gl.float32, [NG, 2],
                         gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).store(sums)
    async_copy.wait_group(0)
    if F16 or XP:  # (a thread rewrites the rows it copied: its own copies have landed)
        NB: gl.constexpr = xs.shape[0] * 16 // T
        FEW: gl.constexpr = min(NB, 4)
        if CHUNKS * 16 <= FEW * T:
            _rows_as_pairs(xs, FEW, T, WARPS, F16)
        else:
            _rows_as_pairs(xs, NB, T, WARPS, F16)
    cta_barrier()


@gluon.jit
def _rows_as_pairs(xs, NB: gl.constexpr, T: gl.constexpr, WARPS: gl.constexpr,
                   F16: gl.constexpr):
    """Each thread's rows of x's copy xs (its first NB blocks of T rows of 4 words; row r of each
    block, as _x_to_smem copied them) rewritten in place as their B pairs (fp16 with F16, else
    bf16): one load and one store for all of them, so that one barrier (before the store) orders
    the warps' accesses, not two a block."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [1, WARPS, 1], [2, 1, 0])
    view = smem_reinterpret(xs, gl.int32, [NB, T, 4], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    a, c = gl.split(gl.reshape(view.load(L3), [NB, T, 2, 2]))
    w0, w2 = gl.split(a)
    w1, w3 = gl.split(c)
    p = gl.inline_asm_elementwise(_F16_PAIRS if F16 else _PAIRS, "=r,=r,=r,=r,r,r,r,r",
                                  [w0, w1, w2, w3], dtype=(gl.int32,) * 4, is_pure=True,
                                  pack=1)
    v = gl.reshape(gl.join(gl.join(p[0], p[2]), gl.join(p[1], p[3])), [NB, T, 4])
    view.store(gl.convert_layout(v, L3))


@gluon.jit
def _lanes(f, B2: gl.constexpr, L: gl.constexpr, T: gl.constexpr):
    """A word of x's rows 0..3 ([4], lanes 0..3 of each quad) as the [T] tensor whose lane 4g + t
    holds row t's (the reshapes only relabel registers)."""
    f = gl.convert_layout(f, gl.SliceLayout(0, B2))
    f = gl.expand_dims(f, 0).broadcast_to([T // 4, 4])
    return gl.convert_layout(gl.reshape(f, [T]), L)


@gluon.jit
def _x_smem(xs, grp, s: gl.constexpr, L: gl.constexpr, T: gl.constexpr, WARPS: gl.constexpr,
            F16: gl.constexpr = False, XP: gl.constexpr = False):
    """Step s's B pairs of group grp from the shared-memory copy of x: lane 4g + t reads row
    4s + t of the group (one ld.shared.v4, the same 16 bytes for the quad's eight lanes; F16
    or XP: the row holds its pairs already, fp16 or bf16)."""
    LX: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, WARPS], [0, 1])
    B2: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [WARPS, 1], [1, 0])
    v = xs.index(grp).slice(4 * s, 4, dim=0).load(LX)  # (rows, words)
    a, b = gl.split(gl.reshape(v, [4, 2, 2]))
    w0, w2 = gl.split(a)
    w1, w3 = gl.split(b)
    if F16 or XP:
        r = (_lanes(w0, B2, L, T), _lanes(w1, B2, L, T), _lanes(w2, B2, L, T),
             _lanes(w3, B2, L, T))
    else:
        p = gl.inline_asm_elementwise(
            _PAIRS, "=r,=r,=r,=r,r,r,r,r",
            [_lanes(w0, B2, L, T), _lanes(w1, B2, L, T), _lanes(w2, B2, L, T),
             _lanes(w3, B2, L, T)], dtype=(gl.int32,) * 4, is_pure=True, pack=1)
        r = (p[0], p[1], p[2], p[3])
    return r


@gluon.jit
def _shfl(v, src):
    return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;",
                                     "=r,r,r", [v, src], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _chunk_sz(sbuf, lane, L: gl.constexpr, T: gl.constexpr, WARPS: gl.constexpr):
    """A group's scales and zero points from the chunk's row of them (tile_scales), as _ld_group
    gives them: lane 4g + t of warp w reads word 32w + 4g + t, and the four lanes of a channel
    quad exchange theirs."""
    L1: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS], [1, 0])
    v = gl.convert_layout(gl.reshape(sbuf.load(L1), [T]), L)
    quad = lane - lane % 4
    s01 = _shfl(v, quad)
    s23 = _shfl(v, quad + 1)
    z01 = _shfl(v, quad + 2)
    z23 = _shfl(v, quad + 3)
    return (s01, s23, s01, s01), (z01, z23, z01, z01)


# RELEASE: a consumed chunk's slot is given back by a proxy fence and one arrive on its `empty`
# barrier, which Gluon lowers to a barrier of the consumer warps and one thread's
# mbarrier.arrive; the producer waits on that arrival and then issues the TMA that overwrites
# the slot. The barrier alone does not order the warps' shared loads before that async-proxy
# write: ptxas may leave a load's value still to come (its MMA after the barrier), and the
# row-tile kernel (decode_rows.py), whose consumer gave slots back that way, read a refilled
# slot about twice in 1,000 calls until the fence went in. The offline compile test checks
# that the fence and the barrier are there.
@gluon.jit
def _gemv_piece(bufs, sbufs, ready, empty, i, u, end, CHUNKS, N, W, s_ptr, z_ptr, s_off, x_base,
                part_ptr, pid, idx, t, g, zero, ones, sel, LW: gl.constexpr, L: gl.constexpr,
                T: gl.constexpr, S: gl.constexpr, X_AHEAD: gl.constexpr, SZ: gl.constexpr,
                WARPS: gl.constexpr, ACC2: gl.constexpr = False, xs=None,
                XS: gl.constexpr = False, PAIR: gl.constexpr = False,
                F16: gl.constexpr = False, PIPE: gl.constexpr = False, xsb=None,
                XSUM: gl.constexpr = 0, XP: gl.constexpr = False):
    """The program's groups [g0, g1) of one tile from unit u on: its MMAs over the ring's
    chunks (SZ: each chunk's scales and zero points in sbufs, else read from global memory a
    group ahead; ACC2: even and odd steps on two sets of accumulators, half the MMA chain; XS:
    x from its shared-memory copy xs, else through L2 X_AHEAD steps ahead; PAIR, with SZ: two
    chunks between the consumer warps' barriers, both waited for first so that the second's
    loads and conversions overlap the first's MMAs; F16, with XS and SZ: fp16 operands,
    _tile_f16_asm; PIPE, with XS and SZ on bf16 operands: each chunk's words, B pairs and
    scales read into registers while the chunk before's MMAs run, _chunk_regs; XSUM, with
    PIPE: the groups' input sums from xsb, no constant-weight MMAs; XP, with XS on bf16
    operands: xs holds B pairs already, _x_to_smem), its float32 sums
    stored as the tile's piece (pid - first). Returns (chunks consumed so far, groups done,
    tile, the tile's pieces)."""
    pid_n = u // CHUNKS
    g0 = u % CHUNKS
    g1 = gl.minimum(CHUNKS, g0 + (end - u))
    first = (pid_n * CHUNKS) // W
    n_pieces = ((pid_n + 1) * CHUNKS - 1) // W - first + 1
    n_lane = pid_n * T + (idx // 32) * 32 + g * 4
    xa = x_base + (g0 * 16 + t).to(gl.int64) * 16
    g_step = (N * 2).to(gl.int64)
    last = (g1 - g0) * 4 - 1
    if not SZ:  # scales and zero points from global memory, a group ahead
        sa = s_ptr.to(gl.int64) + (s_off + (g0 * N).to(gl.int64) + n_lane) * 2
        za = z_ptr.to(gl.int64) + (s_off + (g0 * N).to(gl.int64) + n_lane) * 2
        sz_n = _ld_group(sa, za, V, True)
    if not XS:
        x_q = _x_queue(xa, last, X_AHEAD)
    y = (zero, zero, zero, zero, zero, zero, zero, zero)
    c_first = 0
    if not XS:
        x_q0 = x_q
    else:
        x_q0 = zero
    if PIPE:  # (with XS and SZ, bf16) the next chunk's registers loaded under this one's MMAs
        s0 = i % S
        mbarrier.wait(ready.index(s0), (i // S) & 1)
        cur = _chunk_regs(bufs.index(s0), sbufs.index(s0), xs, g0, idx % 32, LW, L, T, WARPS,
                          xsb, XSUM, XP)
        for c in range(g1 - g0):
            w_c, x_c, sz_c = cur
            acc, cx = _regs_mma(w_c, x_c, zero, ones, sel, ACC2, XSUM, sz_c[4])
            nxt = cur
            if c + 1 < g1 - g0:
                s1 = (i + 1) % S
                mbarrier.wait(ready.index(s1), ((i + 1) // S) & 1)
                nxt = _chunk_regs(bufs.index(s1), sbufs.index(s1), xs, g0 + c + 1, idx % 32, LW,
                                  L, T, WARPS, xsb, XSUM, XP)
            y = _group_done(y, acc, cx, _sz_pairs(sz_c), 0, V, True, True, 4)
            # the slot may be refilled (RELEASE, above)
            fence_async_shared()
            mbarrier.arrive(empty.index(i % S), count=1)
            i += 1
            cur = nxt
        c_first = g1 - g0
    if PAIR:
        for cp in range((g1 - g0) // 2):
            s0 = i % S
            s1 = (i + 1) % S
            mbarrier.wait(ready.index(s0), (i // S) & 1)
            mbarrier.wait(ready.index(s1), ((i + 1) // S) & 1)
            sz0 = _chunk_sz(sbufs.index(s0), idx % 32, L, T, WARPS)
            sz1 = _chunk_sz(sbufs.index(s1), idx % 32, L, T, WARPS)
            acc0, cx0, x_q0 = _chunk_mma(bufs.index(s0), xs, x_q0, xa, g0, 2 * cp, last, zero,
                                         ones, sel, LW, L, T, X_AHEAD, WARPS, XS, ACC2, F16, XP)
            acc1, cx1, x_q0 = _chunk_mma(bufs.index(s1), xs, x_q0, xa, g0, 2 * cp + 1, last,
                                         zero, ones, sel, LW, L, T, X_AHEAD, WARPS, XS, ACC2,
                                         F16, XP)
            # every consumer warp's loads of both chunks are done before they are refilled
            cta_barrier()
            fence_async_shared()
            mbarrier.arrive(empty.index(s0), count=1)
            mbarrier.arrive(empty.index(s1), count=1)
            i += 2
            if F16:
                y = _group_done_f16(y, acc0, cx0, sz0)
                y = _group_done_f16(y, acc1, cx1, sz1)
            else:
                y = _group_done(y, acc0, cx0, sz0, 0, V, True, True, 4)
                y = _group_done(y, acc1, cx1, sz1, 0, V, True, True, 4)
        c_first = ((g1 - g0) // 2) * 2
    for c in range(c_first, g1 - g0):
        slot = i % S
        if not SZ:
            sz = sz_n
            gn = gl.minimum(c + 1, g1 - g0 - 1)
            sz_n = _ld_group(sa + gn * g_step, za + gn * g_step, V, True)
        mbarrier.wait(ready.index(slot), (i // S) & 1)
        buf = bufs.index(slot)
        if SZ:
            sz = _chunk_sz(sbufs.index(slot), idx % 32, L, T, WARPS)
        acc, cx, x_q0 = _chunk_mma(buf, xs, x_q0, xa, g0, c, last, zero, ones, sel, LW, L, T,
                                   X_AHEAD, WARPS, XS, ACC2, F16, XP)
        # the slot may be refilled (RELEASE, above)
        fence_async_shared()
        mbarrier.arrive(empty.index(slot), count=1)
        i += 1
        if F16:
            y = _group_done_f16(y, acc, cx, sz)
        else:
            y = _group_done(y, acc, cx, sz, 0, V, True, True, 4)
    _store(part_ptr + (pid - first).to(gl.int64) * N, n_lane, y, t == 0, V, False)
    return i, g1 - g0, pid_n, n_pieces


@gluon.jit
def _chunk_regs(buf, sbuf, xs, grp, lane, LW: gl.constexpr, L: gl.constexpr, T: gl.constexpr,
                WARPS: gl.constexpr, xsb=None, XSUM: gl.constexpr = 0, XP: gl.constexpr = False):
    """A chunk's registers for _regs_mma, read from shared memory at once: each step's four
    distinct words of the lane (_words), its B pairs (x's group grp, _x_smem) and the group's
    scales and zero points (s01, s23, z01, z23; _chunk_sz); XSUM: and the group's input sum
    from xsb as a fifth, else zeros."""
    a = _words(buf, 0, LW, L, T)
    b = _words(buf, 4, LW, L, T)
    c = _words(buf, 8, LW, L, T)
    d = _words(buf, 12, LW, L, T)
    w = ((a[0], a[1], a[4], a[5]), (b[0], b[1], b[4], b[5]), (c[0], c[1], c[4], c[5]),
         (d[0], d[1], d[4], d[5]))
    x = (_x_smem(xs, grp, 0, L, T, WARPS, False, XP),
         _x_smem(xs, grp, 1, L, T, WARPS, False, XP),
         _x_smem(xs, grp, 2, L, T, WARPS, False, XP),
         _x_smem(xs, grp, 3, L, T, WARPS, False, XP))
    s, z = _chunk_sz(sbuf, lane, L, T, WARPS)
    if XSUM:
        LB: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [WARPS, 1], [1, 0])
        xsum = gl.sum(gl.sum(xsb.index(grp).load(LB), 1), 0) + gl.zeros([T], gl.float32,
                                                                        layout=L)
    else:
        xsum = gl.zeros([T], gl.float32, layout=L)
    return w, x, (s[0], s[1], z[0], z[1], xsum)


@gluon.jit
def _sz_pairs(sz):
    """_chunk_regs' (s01, s23, z01, z23) as _group_done takes them."""
    return (sz[0], sz[1], sz[0], sz[0]), (sz[2], sz[3], sz[2], sz[2])


@gluon.jit
def _weights_step(acc, cx, ones, w, b, sel, XSUM: gl.constexpr):
    """_step on bf16 operands, or with XSUM the two M-tiles' MMAs alone (cx passed through)."""
    if XSUM:
        r = ((_tiles(w, 0, b, acc[0], sel, 4, True), _tiles(w, 1, b, acc[1], sel, 4, True),
              acc[2], acc[3]), cx)
    else:
        r = _step(acc, cx, ones, w, b, sel, V, True, 4)
    return r


@gluon.jit
def _regs_mma(w, x, zero, ones, sel, ACC2: gl.constexpr = False, XSUM: gl.constexpr = 0,
              xsum=None):
    """_chunk_mma's four steps on registers _chunk_regs read (bf16 operands): (acc, cx). XSUM:
    the weights' MMAs alone, cx the group's input sum xsum (no constant-weight MMA a step)."""
    c4 = (zero, zero, zero, zero)
    acc = (c4, c4, c4, c4)
    cx = c4
    acc_b = acc
    cx_b = c4
    for s in gl.static_range(4):
        e = w[s]
        w_c = (e[0], e[1], e[0], e[0], e[2], e[3], e[0], e[0])
        if ACC2 and (s % 2 == 1):
            acc_b, cx_b = _weights_step(acc_b, cx_b, ones, w_c, x[s], sel, XSUM)
        else:
            acc, cx = _weights_step(acc, cx, ones, w_c, x[s], sel, XSUM)
    if ACC2:
        acc = (_add4(acc[0], acc_b[0]), _add4(acc[1], acc_b[1]), acc[2], acc[3])
        cx = _add4(cx, cx_b)
    if XSUM:
        cx = (xsum, xsum, xsum, xsum)
    return acc, cx


@gluon.jit
def _chunk_mma(buf, xs, x_q, xa, g0, c, last, zero, ones, sel, LW: gl.constexpr,
               L: gl.constexpr, T: gl.constexpr, X_AHEAD: gl.constexpr, WARPS: gl.constexpr,
               XS: gl.constexpr, ACC2: gl.constexpr = False, F16: gl.constexpr = False,
               XP: gl.constexpr = False):
    """Chunk c's four steps (the piece's group g0 + c) on fresh accumulators (ACC2: odd steps
    on a second set, added at the end; F16: fp16 operands, one set; XP: xs holds bf16 B pairs):
    (acc, cx, x's queue; with XS the queue is passed through)."""
    c4 = (zero, zero, zero, zero)
    acc = (c4, c4, c4, c4)
    cx = c4
    acc_b = acc
    cx_b = c4
    for s in gl.static_range(4):
        w_c = _words(buf, s * 4, LW, L, T)
        if XS:
            x_c = _x_smem(xs, g0 + c, s, L, T, WARPS, F16, XP)
        else:
            x_c = x_q[0]
            x_nxt = gl.minimum(c * 4 + s + X_AHEAD, last)
            x_q = _push(x_q, _ld_x(xa + x_nxt * 64), X_AHEAD)
        if F16:
            acc, cx = _step_f16(acc, cx, w_c, x_c)
        elif ACC2 and (s % 2 == 1):
            acc_b, cx_b = _step(acc_b, cx_b, ones, w_c, x_c, sel, V, True, 4)
        else:
            acc, cx = _step(acc, cx, ones, w_c, x_c, sel, V, True, 4)
    if ACC2 and not F16:
        acc = (_add4(acc[0], acc_b[0]), _add4(acc[1], acc_b[1]), acc[2], acc[3])
        cx = _add4(cx, cx_b)
    return acc, cx, x_q


@gluon.jit
def _tile_sum(part_ptr, n_pieces, N, offs, need=True, UNROLL: gl.constexpr = 8,
              REST: gl.constexpr = True):
    """A tile's float32 sums at offs: its pieces' partials added in piece order (need false:
    no loads, zeros). The first UNROLL pieces' loads are unrolled (masked), so that they are in
    flight together rather than one round trip after another; more pieces than that are added
    by a loop (REST; else by _tile_rest, so that a caller can issue other loads first)."""
    ok = (offs >= 0) & need
    tot = gl.load(part_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
    for q in gl.static_range(1, UNROLL):
        tot += gl.load(part_ptr + (q * N + offs), mask=ok & (q < n_pieces), other=0.0,
                       cache_modifier=".cg")
    if REST:
        tot = _tile_rest(tot, part_ptr, n_pieces, N, offs, need, UNROLL)
    return tot


@gluon.jit
def _tile_rest(tot, part_ptr, n_pieces, N, offs, need=True, UNROLL: gl.constexpr = 8):
    """tot plus the partials of pieces UNROLL .. n_pieces - 1 (_tile_sum's loop)."""
    if need:
        for p in range(UNROLL, n_pieces):
            tot += gl.load(part_ptr + (p * N + offs), cache_modifier=".cg")
    return tot


def tile_words(qweight: torch.Tensor, tile: int) -> torch.Tensor:
    """(K/8, N) words -> (units * 16, tile): unit (tile i, group j), tile-major, is rows
    [16 (i * groups + j), + 16), the words of group j's 16 word rows and tile i's channels in
    the order the consumer lanes read them (_words): step s (word rows 4s .. 4s + 3), warp w
    (32 channels), channel quad g, word row 4s + t, the quad's 4 words. A step's row reads a
    warp's 512 bytes whole, where a plain (row, channel) order would put the four rows a
    quarter-warp reads in the same shared-memory banks."""
    k8, n = qweight.shape
    groups = k8 // 16
    units = qweight.view(groups, 16, n // tile, tile).permute(2, 0, 1, 3)
    return (units.reshape(n // tile, groups, 4, 4, tile // 32, 8, 4)  # (.., s, t, w, g, word)
            .permute(0, 1, 2, 4, 5, 3, 6).reshape(-1, tile).contiguous())


def unit_rows(words: torch.Tensor, tile: int) -> torch.Tensor:
    """tile_words' units back in (word row, channel) order: (units, 16, tile)."""
    units = words.shape[0] // 16
    return (words.reshape(units, 4, tile // 32, 8, 4, 4)  # (unit, s, w, g, t, word)
            .permute(0, 1, 4, 2, 3, 5).reshape(units, 16, tile))


@gluon.constexpr_function
def word_layout(warps):
    """The register layout of a step's 4 rows of a chunk (4, 32 * warps), as _words reads
    them: a warp's 512 bytes, 16 contiguous bytes a lane."""
    return gl.BlockedLayout([1, 4], [1, 32], [4, int(warps) // 4], [1, 0])


def share(tiles: int, groups: int, programs: int) -> int:
    """Units a program: an even share, at least two."""
    return max(2, -(-tiles * groups // programs))


def tile_scales(scales: torch.Tensor, zeros: torch.Tensor, tile: int) -> torch.Tensor:
    """Scales and zero points (groups, N) by (tile, group) unit, in tile_words' unit order:
    (units, tile) int32, a quad of channels 4q .. 4q + 3 at words 4q .. 4q + 3 as (s0, s1),
    (s2, s3), (z0, z1), (z2, z3), 16-bit pairs with the lower channel in the low half."""
    groups, n = scales.shape
    s32 = scales.contiguous().view(torch.int32).view(groups, n // 4, 2)
    z32 = zeros.contiguous().view(torch.int32).view(groups, n // 4, 2)
    sz = torch.cat([s32, z32], 2).reshape(groups, n // tile, tile)
    return sz.permute(1, 0, 2).reshape(-1, tile).contiguous()
