"""A decode step's layers in one persistent kernel at batch 1, for 4-bit Llama-style models on
sm_90+ (Gluon): the weights stream through a TMA ring while the layer's short phases wait on
each other.

A kernel a phase leaves HBM idle at every boundary: the launch, the first loads' round trip and
the tail of each GEMV, and the short kernels between them (RMSNorm, RoPE and the K/V store,
attention's split and merge, SiLU-and-mul). Here one program an SM runs all the layers:

- a producer warp copies the program's share of every projection's weight, in the order the
  layers use them, into a ring of shared-memory chunks by TMA, waiting only for a free chunk: a
  chunk is one (tile of 32 channels a consumer warp, group of 128 inputs) unit of the layout's
  own words (`tile_words`, value j of a word in bits 4j), with the unit's scales and zero points
  beside it (`tile_scales`);
- WARPS consumer warps (4 or 8: a tile of one or two heads) walk the phases. A phase starts when
  every program has counted the phase before it done (a release add, polled with acquire loads
  by one thread of the program while the others wait at a barrier; POLL1, else by every thread)
  and reads what that phase wrote through L2.

A layer is five phases (the RMSNorms, RoPE and the K/V store, the attention merge, SiLU-and-mul
and the residual adds folded into the phases around them):

1. qkv. The input is xn = h * g (the input norm's weight) rounded to bf16, written by the phase
   that wrote h, with its tiles' sums of h^2; RMSNorm's 1 / rms is a scalar a row, so it scales
   the projection's sums at the end. A tile holds whole heads: its last piece scales, rounds,
   rotates q and k (the partner of channel c is c ^ 64, read from the same partials), and stores
   q, or k and v into the paged cache at the step's slot. (FOLD: the attention programs do this
   themselves from the partials, and the qkv tiles have no finish.)
2. attention. KV heads x SPLITS programs each take a share of the context for the head's four
   query heads (online softmax, float32; the earlier steps' K/V rows are read before the wait)
   and store (m, l, acc); the last share of a head to arrive merges them (bf16).
3. o. The tile's last piece adds the residual: h = h + o (bf16), xn = h * g (the post-attention
   norm's weight), the tile's sum of h^2.
4. gate/up. The weight's channels are reordered so a tile's first half holds gate channels and
   its second half the same up channels (`gate_up_order`); its last piece scales by 1 / rms and
   stores silu(gate) * up (bf16).
5. down. As o, with the next layer's input norm weight (the final norm's after the last layer).

A projection's units are shared out evenly over the programs (stream-K); each piece stores its
float32 partials and the last piece of a tile to arrive (a ticket) adds them in piece order and
does the tile's finish: the result does not depend on which program arrives last. A program
reads a piece's ticket only after its next piece's work, so that the atomic's round trip
(long while the weight stream fills the memory system) costs no wait.

The norms' rounding differs from the layer-by-layer path's (which rounds h * (1 / rms) before
the weight): the input each projection reads is rounded once, as h * g. The GEMV work itself is
the int4 tensor-core GEMV's (wna16_gemv_tc.py): each lane's words read from the chunk into the
registers its MMAs take them from, x from a copy in shared memory made once a phase (or, a
form for comparison, through L2 a few steps ahead). A one-program-a-tile prologue kernel
writes the first phase's inputs (h, the token's embedding row; xn; the tiles' sums of h^2) and
zeroes the counters and tickets, one launch before the persistent one. A phase that waits far
longer than any phase takes (a program that never arrives) traps rather than hanging the GPU.
`DecodeLayers` packs a model's layers and runs the two kernels;
`benchmarks/decode_layer_ring.py` checks and times it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from peregrine.kernels._gluon import (cta_barrier, fence_acq_rel_gpu_if, globaltimer,
                                      ring_barriers, ticket_release, tma_load, wait_count,
                                      wait_count_one)
from peregrine.kernels.ring_attention import (_attention, _attn_early, _attn_inputs,
                                              _attn_inputs_folded)
from peregrine.kernels.ring_gemv import (_gemv_piece, _share, _tile_rest, _tile_sum,
                                         _x_to_smem, share, tile_scales, tile_words, unit_rows,
                                         word_layout, x_groups)
from peregrine.layers.quantization.wna16 import WNA16Layout
QKV, ATTN, O, GU, DOWN = 0, 1, 2, 3, 4  # a phase's kind (the table's first field)
K_QKV, K_ATTN, K_GU = gl.constexpr(QKV), gl.constexpr(ATTN), gl.constexpr(GU)
# int64 fields a phase: kind, row base, units a program, units, groups, N, scale offset, input
# offset, norm weight offset, the layer's K and V cache offsets (elements from layer 0's)
TABF = gl.constexpr(11)
LOCKS = 256  # split-K tickets (tiles); the attention's follow
LOCKS_C = gl.constexpr(LOCKS)
# TRACE's timestamps a phase and program: its wait ended, it ended, it began to wait, its input
# was in shared memory, its first piece's MMAs were done, its last piece's (the GEMV phases)
TRACE_POINTS = 6
TW = gl.constexpr(TRACE_POINTS)


@gluon.jit
def _finish(kind, j, n_pieces, N, part_ptr, vec_ptr, g_ptr, ss_ptr, cs_ptr, pos, slot,
            kc_ptr, vc_ptr, eps, H: gl.constexpr, HEADS: gl.constexpr, KVH: gl.constexpr,
            D: gl.constexpr, T: gl.constexpr, L: gl.constexpr, XSUM: gl.constexpr = 0):
    """Tile j's finish, once its sums are all in (see the module docstring): T channels (whole
    heads of D = 128), one a thread; a channel's RoPE partner is c ^ 64, a gate channel's up
    channel c + T / 2. Every load the finish needs is issued first, together (one round trip
    to L2, not one after another: the weight stream makes each one long). XSUM: the sums of
    the next GEMV's inputs it writes (xn, silu(gate) * up), a block of 64 at a time, beside
    the tiles' sums of squares (_block_sums)."""
    HALF: gl.constexpr = T // 2
    c = gl.arange(0, T, layout=L)
    n = j * T + c  # the projection's channel
    e = c % D  # the channel within its head
    Q_OFF: gl.constexpr = 2 * H
    AT_OFF: gl.constexpr = Q_OFF + HEADS * D
    ACT_OFF: gl.constexpr = AT_OFF + HEADS * D
    normed = (kind == K_QKV) | (kind == K_GU)
    rope = (kind == K_QKV) & (j * T < (HEADS + KVH) * D)  # q or k: RoPE at the step's position
    if kind == K_QKV:
        partner = n + 64 - 2 * ((e // 64) * 64)  # n ^ 64
    else:
        partner = n + HALF - 2 * ((c // HALF) * HALF)  # gate <-> up
    y = _tile_sum(part_ptr, n_pieces, N, n, REST=False)
    y_p = _tile_sum(part_ptr, n_pieces, N, partner, normed, REST=False)
    sq = gl.load(ss_ptr + c, mask=(c < H // T) & normed, other=0.0, cache_modifier=".cg")
    cos = gl.load(cs_ptr + pos * D + (e % 64), mask=rope & (c >= 0), other=0.0)
    sin = gl.load(cs_ptr + pos * D + 64 + (e % 64), mask=rope & (c >= 0), other=0.0)
    h = gl.load(vec_ptr + n, mask=(c >= 0) & ~normed, other=0.0, cache_modifier=".cg")
    gw = gl.load(g_ptr + n, mask=(c >= 0) & ~normed, other=0.0)
    y = _tile_rest(y, part_ptr, n_pieces, N, n)  # (more pieces than were unrolled)
    y_p = _tile_rest(y_p, part_ptr, n_pieces, N, partner, normed)
    if normed:
        rr = gl.rsqrt(gl.sum(sq, 0) / H + eps)
        y = (y * rr).to(gl.bfloat16).to(gl.float32)
        y_p = (y_p * rr).to(gl.bfloat16).to(gl.float32)
        if kind == K_QKV:
            head = n // D  # q heads, then k heads, then v heads; a tile holds one kind
            if rope:  # rotate-half
                sign = gl.where(e < 64, -1.0, 1.0)
                r = (y * cos + sign * y_p * sin).to(gl.bfloat16)
                if j * T < HEADS * D:
                    gl.store(vec_ptr + Q_OFF + n, r)
                elif slot >= 0:  # (slot -1: a padding row stores no K/V)
                    gl.store(kc_ptr + (slot * KVH + (head - HEADS)) * D + e, r)
            elif slot >= 0:
                gl.store(vc_ptr + (slot * KVH + (head - HEADS - KVH)) * D + e,
                         y.to(gl.bfloat16))
        else:  # gate channels in the tile's first half, the same up channels in its second
            act = (y / (1.0 + gl.exp(-y)) * y_p).to(gl.bfloat16)
            gl.store(vec_ptr + ACT_OFF + j * HALF + c, act, mask=c < HALF)
            if XSUM:
                _block_sums(ss_ptr, (ACT_OFF + j * HALF) // 64, c, act, HALF, H)
    else:  # o or down: the residual add, the next norm's input and the tile's sum of h^2
        y = y.to(gl.bfloat16).to(gl.float32)
        hb = (h.to(gl.float32) + y).to(gl.bfloat16)
        gl.store(vec_ptr + n, hb)
        hf = hb.to(gl.float32)
        xn = (hf * gw.to(gl.float32)).to(gl.bfloat16)
        gl.store(vec_ptr + H + n, xn)
        gl.store(ss_ptr + j, gl.sum(hf * hf, 0))
        if XSUM:
            _block_sums(ss_ptr, (H + j * T) // 64, c, xn, T, H)


@gluon.jit
def _block_sums(ss_ptr, b0, c, v, COUNT: gl.constexpr, H: gl.constexpr):
    """The float32 sums of v's bf16 values at c < COUNT, a block of 64 at a time, stored as
    the input sums of the arena's blocks b0, b0 + 1, .. (after the tiles' sums of squares:
    `block_sums_at`)."""
    f = v.to(gl.float32)
    for b in gl.static_range(COUNT // 64):
        gl.store(ss_ptr + (H // 32) + b0 + b, gl.sum(gl.where(c // 64 == b, f, 0.0), 0))


@gluon.jit
def _settle(j, n_pieces, tk, kind, N, part_ptr, vec_ptr, g_ptr, ss_ptr, cs_ptr, pos, slot,
            kc_ptr, vc_ptr, lock_ptr, idx, eps, H: gl.constexpr, HEADS: gl.constexpr,
            KVH: gl.constexpr, D: gl.constexpr, T: gl.constexpr, L: gl.constexpr,
            SKIP: gl.constexpr, XSUM: gl.constexpr = 0):
    """Tile j's piece's ticket tk (thread 0's, the count before it; -1 in the other threads):
    where it was the tile's last piece, thread 0 fences (acquire: the other pieces' partials
    are visible to it, and so, past the reduction's barrier, to every thread), the tile's
    finish, and its ticket back to zero. j < 0: no piece."""
    if j >= 0:
        fence_acq_rel_gpu_if((tk == n_pieces - 1).to(gl.int32))
        ticket = gl.max(tk, 0)
        if (ticket == n_pieces - 1) and (SKIP & 1 == 0):
            _finish(kind, j, n_pieces, N, part_ptr, vec_ptr, g_ptr, ss_ptr, cs_ptr, pos, slot,
                    kc_ptr, vc_ptr, eps, H, HEADS, KVH, D, T, L, XSUM)
            # (relaxed: the phase-end release add publishes it before the ticket is used again)
            gl.atomic_xchg(lock_ptr + j, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _wait_phase(ptr, target, idx, POLL1: gl.constexpr):
    """wait_count, or with POLL1 wait_count_one (one thread of the program polls)."""
    if POLL1:
        wait_count_one(ptr, target, idx)
    else:
        wait_count(ptr, target)


@gluon.jit
def _consumer(bufs, sbufs, xs, ready, empty, tab_ptr, n_phases, s_ptr, z_ptr, vec_ptr, norm_ptr,
              ss_ptr, part_ptr, apart_ptr, lock_ptr, cnt_ptr, cs_ptr, pos_ptr, slot_ptr, bt_ptr,
              kc_ptr, vc_ptr, trace_ptr, eps, scale, P, S: gl.constexpr, WARPS: gl.constexpr,
              H: gl.constexpr, HEADS: gl.constexpr, KVH: gl.constexpr, D: gl.constexpr,
              BS: gl.constexpr, SPLITS: gl.constexpr, TB: gl.constexpr, WAIT: gl.constexpr,
              TRACE: gl.constexpr, X_AHEAD: gl.constexpr, SZ: gl.constexpr, SKIP: gl.constexpr,
              FOLD: gl.constexpr, XS: gl.constexpr, DEFER: gl.constexpr, ACC2: gl.constexpr,
              PAIR: gl.constexpr, F16: gl.constexpr, PIPE: gl.constexpr, xsb,
              XSUM: gl.constexpr, POLL1: gl.constexpr, XP: gl.constexpr):
    """The consumer warps: the phases in order (see decode_layers_kernel)."""
    T: gl.constexpr = 32 * WARPS
    L: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    LW: gl.constexpr = word_layout(WARPS)
    LK: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
    pid = gl.program_id(0)
    idx = gl.arange(0, T, layout=L)
    lane = idx % 32
    g = lane // 4
    t = lane % 4
    sel = gl.where(t % 2 == 0, 0x4140, 0x4342)
    zero = gl.zeros([T], gl.float32, layout=L)
    ones = gl.full([T], 0x3F803F80, gl.int32, layout=L)
    pos = gl.load(pos_ptr).to(gl.int64)
    slot = gl.load(slot_ptr).to(gl.int64)
    i = 0
    for f in range(n_phases):
        kind = gl.load(tab_ptr + f * TABF).to(gl.int32)
        W = gl.load(tab_ptr + f * TABF + 2).to(gl.int32)
        total = gl.load(tab_ptr + f * TABF + 3).to(gl.int32)
        CHUNKS = gl.load(tab_ptr + f * TABF + 4).to(gl.int32)
        N = gl.load(tab_ptr + f * TABF + 5).to(gl.int32)
        s_off = gl.load(tab_ptr + f * TABF + 6)
        x_off = gl.load(tab_ptr + f * TABF + 7)
        g_off = gl.load(tab_ptr + f * TABF + 8)
        kc_l = kc_ptr + gl.load(tab_ptr + f * TABF + 9)  # the layer's caches
        vc_l = vc_ptr + gl.load(tab_ptr + f * TABF + 10)
        if SKIP & 2 == 0:
            attn = (kind == K_ATTN) & (pid < KVH * SPLITS)
            kt0 = gl.zeros([TB, D], gl.bfloat16, layout=LK)
            vt0 = kt0
            if attn:  # the earlier steps' K/V rows need no wait
                kt0, vt0 = _attn_early(pid, kc_l, vc_l, bt_ptr, pos, KVH, D,
                                       BS, SPLITS, TB, WARPS)
        if TRACE:
            gl.store(trace_ptr + (f * P + pid) * TW + 2, globaltimer())
        if WAIT and f > 0:  # every program of the phase before is done
            _wait_phase(cnt_ptr + (f - 1), P, idx, POLL1)
        if TRACE:
            met = globaltimer()
            gl.store(trace_ptr + (f * P + pid) * TW, met)
            for k in gl.static_range(3, TW):  # (an attention phase: the later points unused)
                gl.store(trace_ptr + (f * P + pid) * TW + k, met)
        if kind == K_ATTN:
            if SKIP & 2 == 0:
                if attn:
                    if FOLD:  # the qkv phase's W, groups and N
                        q_w = gl.load(tab_ptr + (f - 1) * TABF + 2).to(gl.int32)
                        q_c = gl.load(tab_ptr + (f - 1) * TABF + 4).to(gl.int32)
                        q_n = gl.load(tab_ptr + (f - 1) * TABF + 5).to(gl.int32)
                        q0, q1, q2, q3, k_cur, v_cur = _attn_inputs_folded(
                            pid, part_ptr, ss_ptr, cs_ptr, vec_ptr, kc_l, vc_l,
                            pos, slot, q_w, q_c, q_n, eps, scale, H, HEADS, KVH, D, T, SPLITS,
                            WARPS)
                    else:
                        q0, q1, q2, q3, k_cur, v_cur = _attn_inputs(
                            pid, vec_ptr, kc_l, vc_l, pos, slot, scale, H,
                            HEADS, KVH, D, SPLITS, WARPS)
                    _attention(pid, vec_ptr, kc_l, vc_l, bt_ptr, pos, q0, q1,
                               q2, q3, k_cur, v_cur, kt0, vt0, apart_ptr, lock_ptr + LOCKS_C, H,
                               HEADS, KVH, D, BS, SPLITS, TB, WARPS, ss_ptr + H // 32, XSUM)
        else:
            x_base = vec_ptr.to(gl.int64) + x_off * 2
            start, end = _share(pid, W, total)
            if XS and start < end:  # the phase's input into shared memory, once
                _x_to_smem(xs, vec_ptr, x_off, CHUNKS, T, WARPS, F16, xsb, ss_ptr + H // 32,
                           XSUM, XP)
            if TRACE:
                gl.store(trace_ptr + (f * P + pid) * TW + 3, globaltimer())
            if FOLD:  # the attention phase finishes qkv's tiles itself
                tiled = kind != K_QKV
            else:
                tiled = kind >= 0
            u = start
            pj = -1  # (DEFER) the piece whose ticket is still out: its tile, pieces, ticket
            pn = 0
            ptk = gl.zeros([T], gl.int32, layout=L)
            while u < end:
                i, done, j, n_pieces = _gemv_piece(
                    bufs, sbufs, ready, empty, i, u, end, CHUNKS, N, W, s_ptr, z_ptr, s_off,
                    x_base, part_ptr, pid, idx, t, g, zero, ones, sel, LW, L, T, S, X_AHEAD, SZ,
                    WARPS, ACC2, xs, XS, PAIR, F16, PIPE, xsb, XSUM, XP)
                if TRACE and u == start:
                    gl.store(trace_ptr + (f * P + pid) * TW + 4, globaltimer())
                u += done
                if tiled:
                    # NOTE: every thread's partial stores come before the ticket (barrier), and
                    # the ticket is a gpu-scope release atomic (thread 0's), so the last piece
                    # sees all partials once it has fenced (_settle).
                    cta_barrier()
                    tk = ticket_release(lock_ptr + j + idx * 0, (idx == 0).to(gl.int32))
                    if DEFER:  # the piece before's ticket now, this one's after the next piece
                        _settle(pj, pn, ptk, kind, N, part_ptr, vec_ptr, norm_ptr + g_off, ss_ptr,
                                cs_ptr, pos, slot, kc_l, vc_l, lock_ptr, idx, eps, H, HEADS,
                                KVH, D, T, L, SKIP, XSUM)
                        pj = j
                        pn = n_pieces
                        ptk = tk
                    else:
                        _settle(j, n_pieces, tk, kind, N, part_ptr, vec_ptr, norm_ptr + g_off,
                                ss_ptr, cs_ptr, pos, slot, kc_l, vc_l, lock_ptr, idx, eps, H,
                                HEADS, KVH, D, T, L, SKIP, XSUM)
            if TRACE:
                gl.store(trace_ptr + (f * P + pid) * TW + 5, globaltimer())
            if DEFER:
                _settle(pj, pn, ptk, kind, N, part_ptr, vec_ptr, norm_ptr + g_off, ss_ptr,
                        cs_ptr, pos, slot, kc_l, vc_l, lock_ptr, idx, eps, H, HEADS, KVH, D, T,
                        L, SKIP, XSUM)
        if TRACE:
            gl.store(trace_ptr + (f * P + pid) * TW + 1, globaltimer())
        cta_barrier()
        gl.atomic_add(cnt_ptr + f, 1, sem="release", scope="gpu")


@gluon.jit
def _layer_producer(desc, sdesc, bufs, sbufs, ready, empty, tab_ptr, n_phases, S: gl.constexpr,
                    T: gl.constexpr, SZ: gl.constexpr):
    """Every phase's units of this program in order into the next free slot: the unit's 16 word
    rows, and with SZ its row of scales and zero points (row base / 16 + unit)."""
    pid = gl.program_id(0)
    i = 0
    for f in range(n_phases):
        base = gl.load(tab_ptr + f * TABF + 1).to(gl.int32)
        W = gl.load(tab_ptr + f * TABF + 2).to(gl.int32)
        total = gl.load(tab_ptr + f * TABF + 3).to(gl.int32)
        start, end = _share(pid, W, total)
        for u in range(start, end):
            slot = i % S
            mbarrier.wait(empty.index(slot), ((i // S) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), (16 + SZ) * T * 4)
            tma_load(desc, [base + u * 16, 0], ready.index(slot), bufs.index(slot))
            if SZ:
                tma_load(sdesc, [base // 16 + u, 0], ready.index(slot), sbufs.index(slot))
            i += 1


@gluon.jit
def decode_layers_kernel(desc, sdesc, tab_ptr, n_phases, s_ptr, z_ptr, vec_ptr, norm_ptr,
                         ss_ptr, part_ptr, apart_ptr, lock_ptr, cnt_ptr, cs_ptr, pos_ptr,
                         slot_ptr, bt_ptr, kc_ptr, vc_ptr, trace_ptr, eps, scale, P,
                         S: gl.constexpr,
                         WARPS: gl.constexpr, H: gl.constexpr, HEADS: gl.constexpr,
                         KVH: gl.constexpr, D: gl.constexpr, BS: gl.constexpr,
                         SPLITS: gl.constexpr, TB: gl.constexpr, WAIT: gl.constexpr = True,
                         TRACE: gl.constexpr = False, X_AHEAD: gl.constexpr = 4,
                         SZ: gl.constexpr = 1, SKIP: gl.constexpr = 0,
                         FOLD: gl.constexpr = 0, XS: gl.constexpr = 0, NG: gl.constexpr = 8,
                         DEFER: gl.constexpr = 0, ACC2: gl.constexpr = 0,
                         PAIR: gl.constexpr = 0, F16: gl.constexpr = 0,
                         PIPE: gl.constexpr = 0, XSUM: gl.constexpr = 0,
                         POLL1: gl.constexpr = 0, XP: gl.constexpr = 0):
    """The layers of the phase table at tab_ptr (TABF int64 fields a phase), from the residual
    stream h and the first norm's input xn and sums of squares (in vec and ss) to the last
    layer's h (see the module docstring). WAIT / TRACE / SKIP are for measurement: without the
    phases' waits, with timestamps, with the tiles' finishes (1) or attention's work (2) left
    out. X_AHEAD: x's steps loaded ahead through L2 (4 or 8) or, with XS, x copied into shared
    memory once a phase (NG groups of 128 inputs: the widest projection's, a power of two); SZ:
    the scales by TMA with the words (else read from global memory); FOLD: attention makes q, k
    and v from the qkv partials; DEFER: a piece's ticket is read after the program's next piece
    (its round trip hidden behind that piece's work), else at once; ACC2: a chunk's even and odd
    steps on two sets of accumulators (half the MMA chain); PAIR (with SZ): two chunks between
    the consumer warps' barriers; F16 (with XS and SZ): the MMAs on fp16 operands, x rewritten
    as fp16 pairs in its shared-memory copy and the weights' values decoded with fewer
    instructions (ring_gemv._tile_f16_asm); PIPE (with XS and SZ, bf16 operands, not PAIR):
    each chunk's registers read while the chunk before's MMAs run; XSUM (with PIPE): each
    group's input sum written once by the phase that writes the input (block_sums_at) and
    copied with x, instead of a constant-weight MMA a step; POLL1: one thread of a program
    polls a phase's counter, the others wait at a barrier; XP (with XS, bf16 operands): x's
    shared-memory copy rewritten once a phase as its bf16 B pairs, so that no MMA step
    rearranges them (four prmt a step fewer; the same bits)."""
    T: gl.constexpr = 32 * WARPS
    bufs = gl.allocate_shared_memory(gl.int32, [S, 16, T], desc.layout)
    sbufs = gl.allocate_shared_memory(gl.int32, [S, 1, T], sdesc.layout)
    xs = gl.allocate_shared_memory(gl.int32, [NG, 16, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    xsb = gl.allocate_shared_memory(gl.float32, [NG, 1, 2],
                                    gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ready, empty = ring_barriers(S)
    gl.warp_specialize([
        (_consumer, (bufs, sbufs, xs, ready, empty, tab_ptr, n_phases, s_ptr, z_ptr, vec_ptr,
                     norm_ptr, ss_ptr, part_ptr, apart_ptr, lock_ptr, cnt_ptr, cs_ptr, pos_ptr,
                     slot_ptr, bt_ptr, kc_ptr, vc_ptr, trace_ptr, eps, scale, P, S, WARPS, H,
                     HEADS, KVH, D, BS, SPLITS, TB, WAIT, TRACE, X_AHEAD, SZ, SKIP, FOLD, XS,
                     DEFER, ACC2, PAIR, F16, PIPE, xsb, XSUM, POLL1, XP)),
        (_layer_producer, (desc, sdesc, bufs, sbufs, ready, empty, tab_ptr, n_phases, S, T,
                           SZ)),
    ], [1], [48])


@triton.jit
def decode_prologue_kernel(table_ptr, tok_ptr, g_ptr, vec_ptr, ss_ptr, lock_ptr, cnt_ptr,
                           n_lock, n_cnt, H: tl.constexpr, T: tl.constexpr):
    """The persistent kernel's inputs, one program a tile of T channels: h = row tok[0] of
    table (the embedding, or the step's row itself with tok 0), xn = h * g rounded to bf16 and
    the tile's sum of h^2 and xn's block sums; program 0 also zeroes the phases' counters and
    the tickets."""
    j = tl.program_id(0)
    c = j * T + tl.arange(0, T)
    row = tl.load(tok_ptr).to(tl.int64)
    h = tl.load(table_ptr + row * H + c)
    tl.store(vec_ptr + c, h)
    hf = h.to(tl.float32)
    g = tl.load(g_ptr + c).to(tl.float32)
    xn = (hf * g).to(tl.bfloat16)
    tl.store(vec_ptr + H + c, xn)
    tl.store(ss_ptr + j, tl.sum(hf * hf, 0))
    # xn's input sums, a block of 64 at a time (block_sums_at)
    tl.store(ss_ptr + H // 32 + (H + j * T) // 64 + tl.arange(0, T // 64),
             tl.sum(tl.reshape(xn.to(tl.float32), (T // 64, 64)), 1))
    if j == 0:
        for k in range(0, n_lock, T):
            tl.store(lock_ptr + k + tl.arange(0, T), 0, mask=k + tl.arange(0, T) < n_lock)
        for k in range(0, n_cnt, T):
            tl.store(cnt_ptr + k + tl.arange(0, T), 0, mask=k + tl.arange(0, T) < n_cnt)


# (programs an SM, ring stages) that DecodeLayers.choose_placement times: the first is the form
# a DecodeLayers is built in
PLACEMENTS = ((1, 16), (2, 8))


def keep_fastest(forms, apply, run, timer=None, iters: int = 5) -> dict:
    """apply(*form) each of forms in turn and time run in it (timer(run, iters) -> ms a call;
    default: CUDA events, the median of `iters` calls after one that compiles; inf where it is
    refused before the launch, its programs not all resident at once), then apply the fastest.
    The ms of each form."""
    timer = timer or _time_ms
    times = {}
    for form in forms:
        apply(*form)
        try:
            times[form] = timer(run, iters)
        except ValueError:  # (refused before the launch: not resident at once)
            times[form] = math.inf
    apply(*min(times, key=times.get))
    return times


def _time_ms(run, iters: int) -> float:
    """The median ms of `iters` calls of run on the current CUDA stream, after one more."""
    run()
    ms = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    return sorted(ms)[len(ms) // 2]


def block_sums_at(hidden: int) -> int:
    """Where the input sums of the arena's blocks of 64 values start in the sums buffer (after
    the tiles' sums of squares: hidden / 32 at least hidden / tile for tiles of 32 or more): the
    XSUM form's GEMVs take a group's input sum from them instead of a constant-weight MMA."""
    return hidden // 32


def gate_up_order(inter: int, half: int = 64) -> torch.Tensor:
    """The gate/up weight's channel order in the kernel: tile j (2 * half channels) holds gate
    channels half * j .. half * (j + 1) - 1, then the same up channels (inter + half * j ..)."""
    gate = torch.arange(inter).view(-1, half)
    return torch.stack([gate, gate + inter], 1).reshape(-1)


@dataclass(frozen=True)
class Dims:
    """A Llama-style model's decode shapes."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    block_size: int
    eps: float


class LayerWeights(NamedTuple):
    """One decoder layer's weights: the projections' 4-bit layouts ((q | k | v) and (gate | up)
    channels, as the layer-by-layer path keeps them) and its two RMSNorm weights."""

    qkv: WNA16Layout
    o: WNA16Layout
    gate_up: WNA16Layout
    down: WNA16Layout
    norm_in: torch.Tensor
    norm_post: torch.Tensor


def offsets(dims: Dims) -> dict[str, int]:
    """Where each vector lives in the kernel's bf16 arena: h, xn, q, the attention output and
    silu(gate) * up (the kernel's own offsets)."""
    h, qd = dims.hidden, dims.heads * dims.head_dim
    return {"h": 0, "xn": h, "q": 2 * h, "attn": 2 * h + qd, "act": 2 * h + 2 * qd,
            "size": 2 * h + 2 * qd + dims.inter}


def attention_splits(programs: int, kv_heads: int, most: int = 16) -> int:
    """Attention programs a KV head: as many as the SMs allow, at most `most` (16 on a 132-SM
    H100 or H200 with 8 KV heads; 14 on a 114-SM one)."""
    return min(most, programs // kv_heads)


def unsupported(dims: Dims, layers: list[LayerWeights], dtype: torch.dtype, warps: int = 4,
                programs: int | None = None, splits: int = 16) -> str | None:
    """Why the kernel cannot run these layers (None: it can)."""
    tile = 32 * warps
    if warps not in (4, 8):
        return f"{warps} consumer warps (4 or 8)"
    if dtype != torch.bfloat16:
        return f"activations in {dtype} (bf16 only)"
    if dims.head_dim != 128 or dims.heads != 4 * dims.kv_heads:
        return (f"{dims.heads} query heads over {dims.kv_heads} KV heads of {dims.head_dim} "
                "channels (four query heads a KV head of 128)")
    for name, n, unit in (("hidden size", dims.hidden, tile),
                          ("KV width", dims.kv_heads * 128, tile),
                          ("intermediate size", dims.inter, max(tile // 2, 128))):
        if n % unit:
            return f"{name} {n} is not a multiple of {unit}"
    if splits < 1:
        return f"{splits} attention programs a KV head"
    if programs is not None and programs < dims.kv_heads * splits:
        return f"{programs} SMs, fewer than the attention's {dims.kv_heads * splits} programs"
    q_out = (dims.heads + 2 * dims.kv_heads) * dims.head_dim
    shapes = {"qkv": (dims.hidden, q_out), "o": (dims.heads * dims.head_dim, dims.hidden),
              "gate_up": (dims.hidden, 2 * dims.inter), "down": (dims.inter, dims.hidden)}
    for i, layer in enumerate(layers):
        for name, (k, n) in shapes.items():
            w: WNA16Layout = getattr(layer, name)
            if w.bits != 4 or w.group_size != 128 or w.g_idx is not None:
                return (f"layer {i} {name}: {w.bits}-bit weights in groups of {w.group_size}"
                        f"{' with act-order' if w.g_idx is not None else ''} (4-bit, groups of "
                        "128 in order)")
            if (w.in_features, w.out_features) != (k, n):
                return (f"layer {i} {name}: {w.in_features} x {w.out_features}, expected "
                        f"{k} x {n}")
            if w.scales.dtype != torch.bfloat16:
                return f"layer {i} {name}: scales in {w.scales.dtype}"
    return None


def check_resident(kernel, programs: int, sms: int, args: tuple, kw: dict, seen: set,
                   name: str) -> None:
    """Programs wait for each other, so all of them must be on the GPU at once: where there
    are more programs than SMs, the compiled form's shared memory and registers must let
    that many share an SM (else the waits would never end). `seen`: the forms checked."""
    if programs <= sms:
        return
    key = tuple(sorted(kw.items()))
    if key in seen:
        return
    props = torch.cuda.get_device_properties(args[2].device)
    per_sm = -(-programs // sms)
    k = kernel.run(*args, grid=(programs,), warmup=True, **kw)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    threads = 32 * int(k.metadata.num_warps)
    need_smem = per_sm * (int(k.metadata.shared) + 1024)
    need_regs = per_sm * threads * int(kw["maxnreg"] or 255)
    if need_smem > smem or need_regs > regs:
        raise ValueError(
            f"{name}: {programs} programs need {per_sm} an SM at once: {need_smem} bytes of "
            f"shared memory (of {smem}) and {need_regs} registers (of {regs})")
    seen.add(key)


def check_caches(dims: Dims, caches: list[tuple[torch.Tensor, torch.Tensor]], layers: int,
                 name: str) -> torch.Tensor:
    """Each layer's (k_cache, v_cache) checked, (blocks, block_size, kv_heads, head_dim) bf16
    and contiguous: their element offsets from layer 0's, (layers, 2) int64."""
    if len(caches) != layers:
        raise ValueError(f"{name}: {len(caches)} layers' caches for {layers} layers")
    k0, v0 = caches[0]
    out = []
    for i, (k, v) in enumerate(caches):
        for kind, c in (("K", k), ("V", v)):
            if (c.dtype != torch.bfloat16 or c.dim() != 4 or not c.is_contiguous()
                    or tuple(c.shape[1:]) != (dims.block_size, dims.kv_heads, dims.head_dim)):
                raise ValueError(f"{name}: layer {i}'s {kind} cache {tuple(c.shape)} {c.dtype} "
                                 f"is not a contiguous bf16 (blocks, {dims.block_size}, "
                                 f"{dims.kv_heads}, {dims.head_dim})")
        out.append([(k.data_ptr() - k0.data_ptr()) // 2, (v.data_ptr() - v0.data_ptr()) // 2])
    return torch.tensor(out, dtype=torch.int64, device=k0.device)


class DecodeLayers:
    """A model's decoder layers packed for decode_layers_kernel, and the call that runs a
    one-row decode step through all of them. The packed weights are a second copy of the
    layers' 4-bit words (the same bytes, in chunk order), beside the scales and zero points.

    warps: consumer warps a program (4 or 8); stages: the ring's chunks (16 word rows of 32
    channels a warp: 8 KB at 4 warps); splits: attention programs a KV head. The attributes
    wait, trace, skip, fold, x_ahead, regs, scales_in_chunk, x_smem, defer, acc2, pair, f16,
    pipe, xsum, poll_one and x_pairs choose the kernel's forms (decode_layers_kernel;
    benchmarks/decode_layer_ring.py times them). Shared memory a program: the ring's stages
    (chunk and scale row) and, with x_smem, the widest input (32 KB for Llama-3-8B): 16 stages
    of 4 warps or 8 of 8 fit beside it, and two programs an SM (`place`) with 8 stages of 4
    warps."""

    def __init__(self, dims: Dims, layers: list[LayerWeights], final_norm: torch.Tensor,
                 device: torch.device, *, warps: int = 4, stages: int = 16, splits: int = 16,
                 tb: int = 16, programs: int | None = None) -> None:
        if programs is None:
            programs = torch.cuda.get_device_properties(device).multi_processor_count
        reason = unsupported(dims, layers, layers[0].qkv.scales.dtype if layers else
                             torch.bfloat16, warps, programs, splits)
        if not layers:
            reason = "no layers"
        if reason is not None:
            raise ValueError(f"decode_layers: {reason}")
        self.dims, self.warps, self.stages, self.splits, self.tb = dims, warps, stages, splits, tb
        self.wait, self.trace, self.skip, self.fold = True, False, 0, 0
        self.x_ahead, self.regs, self.scales_in_chunk, self.x_smem = 4, 128, True, True
        self.defer, self.acc2, self.pair, self.f16, self.pipe = True, False, False, False, False
        self.xsum, self.poll_one, self.x_pairs = False, True, False
        tile = 32 * warps
        self.k_max = max(dims.hidden, dims.heads * dims.head_dim, dims.inter)
        self.order = gate_up_order(dims.inter, tile // 2).to(device)
        off = offsets(dims)
        x_in = {QKV: off["xn"], O: off["attn"], GU: off["xn"], DOWN: off["act"]}
        projections = [(kind, w) for layer in layers
                       for kind, w in ((QKV, layer.qkv), (O, layer.o), (GU, layer.gate_up),
                                       (DOWN, layer.down))]
        units = sum(w.in_features // 128 * (w.out_features // tile) for _, w in projections)
        values = sum(w.scales.numel() for _, w in projections)
        # NOTE: filled in place, so that packing needs the packed size once, not twice
        self.words = torch.empty(16 * units, tile, dtype=torch.int32, device=device)
        self.sz_rows = torch.empty(units, tile, dtype=torch.int32, device=device)
        self.scales = torch.empty(values, dtype=layers[0].qkv.scales.dtype, device=device)
        self.zeros = torch.empty_like(self.scales)
        table = []
        row = s_off = 0
        for f, (kind, w) in enumerate(projections):
            i = f // 4
            q, sc = w.qweight, w.scales
            zp = w.zeros if w.zeros is not None else torch.full_like(sc, 8.0)
            if kind == GU:
                q, sc, zp = q[:, self.order], sc[:, self.order], zp[:, self.order]
            groups, tiles = w.in_features // 128, w.out_features // tile
            n_units = tiles * groups
            self.words[row:row + 16 * n_units] = tile_words(q.contiguous(), tile)
            self.sz_rows[row // 16:row // 16 + n_units] = tile_scales(sc, zp, tile)
            self.scales[s_off:s_off + sc.numel()] = sc.reshape(-1)
            self.zeros[s_off:s_off + sc.numel()] = zp.reshape(-1)
            if kind == O:
                table.append([ATTN, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0])
            g_off = {QKV: 2 * i, O: 2 * i + 1, GU: 0, DOWN: 2 * i + 2}[kind] * dims.hidden
            table.append([kind, row, 0, n_units, groups, w.out_features, s_off, x_in[kind],
                          g_off, 0, 0])
            row += 16 * n_units
            s_off += sc.numel()
        self.norms = torch.cat([torch.cat([lw.norm_in, lw.norm_post]) for lw in layers]
                               + [final_norm]).to(torch.bfloat16)
        self.table = torch.tensor(table, dtype=torch.int64, device=device)
        # the SMs a placement counts programs an SM of (the programs asked for, off a GPU)
        self.sms = (torch.cuda.get_device_properties(device).multi_processor_count
                    if torch.device(device).type == "cuda" else programs)
        self.place(programs)
        f32 = dict(dtype=torch.float32, device=device)
        self.apart = torch.empty(dims.kv_heads * splits * 4 * (dims.head_dim + 2), **f32)
        self.lock = torch.zeros(LOCKS + dims.kv_heads, dtype=torch.int32, device=device)
        self.cnt = torch.zeros(len(table), dtype=torch.int32, device=device)
        self.vec = torch.zeros(off["size"], dtype=torch.bfloat16, device=device)
        # the tiles' sums of h^2, then the arena's blocks' input sums (block_sums_at)
        self.sums = torch.zeros(block_sums_at(dims.hidden) + off["size"] // 64, **f32)
        self.ss = self.sums[:dims.hidden // tile]
        self.zero_token = torch.zeros(1, dtype=torch.int64, device=device)
        self.caches: tuple[torch.Tensor, torch.Tensor] | None = None
        if LOCKS < max(r[3] // r[4] for r in table):
            raise ValueError("decode_layers: more tiles than split-K tickets")
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        self.descs = (TensorDescriptor(self.words, list(self.words.shape),
                                       list(self.words.stride()), [16, tile], layout),
                      TensorDescriptor(self.sz_rows, list(self.sz_rows.shape),
                                       list(self.sz_rows.stride()), [1, tile], layout))

    def place(self, programs: int) -> None:
        """Share every projection's units out over `programs` programs (one an SM, or more where
        that many fit on each SM at once: `__call__` checks before it launches)."""
        d = self.dims
        if programs < d.kv_heads * self.splits:
            raise ValueError(f"decode_layers: {programs} programs, fewer than the attention's "
                             f"{d.kv_heads * self.splits}")
        tab = self.table.cpu()
        for r in tab:
            if r[0] != ATTN:
                r[2] = share(int(r[3]) // int(r[4]), int(r[4]), programs)
        self.table.copy_(tab)
        pieces = max(-(-int(r[4]) // int(r[2])) + 1 for r in tab if r[0] != ATTN)
        n_max = int(tab[:, 5].max())
        dev = self.table.device
        self.part = torch.empty(pieces * n_max, dtype=torch.float32, device=dev)
        self.times = torch.zeros(len(tab), programs, TRACE_POINTS, dtype=torch.int64,
                                 device=dev)
        self.programs = programs
        self._sms = (torch.cuda.get_device_properties(dev).multi_processor_count
                     if dev.type == "cuda" else programs)
        self._resident: set = set()

    def choose_placement(self, run, timer=None, iters: int = 5) -> dict[tuple[int, int], float]:
        """Time `run` (a call of this object on fixed inputs, caches bound) in each placement of
        PLACEMENTS (programs an SM, ring stages) and keep the fastest: one program an SM is
        faster where HBM sets the pace of the long phases, two where the consumer warps do (an
        H100 against an H200, see the benchmarks). A placement whose programs cannot all be
        resident is skipped. timer(run, iters) -> ms a call (default: CUDA events, the median
        of `iters` calls after one that compiles). The ms of each placement tried (inf where
        refused)."""
        return keep_fastest(PLACEMENTS, self._form, run, timer, iters)

    def _form(self, per_sm: int, stages: int) -> None:
        self.stages = stages
        self.place(per_sm * self.sms)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the packed copy of the weights."""
        return sum(t.numel() * t.element_size()
                   for t in (self.words, self.sz_rows, self.scales, self.zeros))

    def bind_caches(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each layer's (k_cache, v_cache), (blocks, block_size, kv_heads, head_dim) bf16: their
        element offsets from layer 0's go into the table."""
        self.table[:, 9:11] = check_caches(self.dims, caches, len(self.table) // 5,
                                           "decode_layers").repeat_interleave(5, 0)
        self.caches = caches[0]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_table: torch.Tensor, cos_sin: torch.Tensor,
                 token: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream (1, hidden) after every layer for one decode row at positions[0],
        its K/V stored at slot_mapping[0], its context in block_table's first row: the row is x
        (1, hidden), or with token, row token[0] of x (the embedding table, (vocab, hidden)).
        cos_sin: the RoPE table (max_pos, head_dim), cos then sin. A view of the kernel's arena:
        read it before the next call."""
        if self.caches is None:
            raise RuntimeError("decode_layers: bind_caches first")
        d, tile = self.dims, 32 * self.warps
        H = d.hidden
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != H or not x.is_contiguous():
            raise ValueError(f"decode_layers: the input {tuple(x.shape)} {x.dtype} is not a "
                             f"contiguous bf16 (rows, {H})")
        if token is None:
            token = self.zero_token
        # NOTE: a run with waits leaves the tickets at zero and one without does not, so the
        # prologue clears them (and the phases' counters) every call, inside a CUDA graph too
        decode_prologue_kernel[(H // tile,)](
            x, token, self.norms, self.vec, self.sums, self.lock, self.cnt, self.lock.numel(),
            self.cnt.numel(), H=H, T=tile, num_warps=4)
        k0, v0 = self.caches
        pipe = int(bool(self.pipe) and self.x_smem and self.scales_in_chunk and not self.f16)
        f16 = int(bool(self.f16) and self.x_smem and self.scales_in_chunk)
        args = (*self.descs, self.table, len(self.table), self.scales, self.zeros, self.vec,
                self.norms, self.sums, self.part, self.apart, self.lock, self.cnt, cos_sin,
                positions, slot_mapping, block_table, k0, v0, self.times, d.eps,
                1.0 / math.sqrt(d.head_dim), self.programs)
        kw = dict(
            S=self.stages, WARPS=self.warps, H=H, HEADS=d.heads, KVH=d.kv_heads, D=d.head_dim,
            BS=d.block_size, SPLITS=self.splits, TB=self.tb, WAIT=self.wait, TRACE=self.trace,
            X_AHEAD=self.x_ahead, SZ=int(self.scales_in_chunk), SKIP=self.skip, FOLD=self.fold,
            XS=int(self.x_smem), DEFER=int(self.defer), ACC2=int(self.acc2),
            PAIR=int(self.pair and self.scales_in_chunk and not pipe),
            F16=f16, PIPE=pipe,
            XSUM=int(bool(self.xsum) and pipe > 0),
            POLL1=int(bool(self.poll_one)),
            XP=int(bool(self.x_pairs) and self.x_smem and not f16),
            NG=x_groups(self.k_max, tile) if self.x_smem else tile // 16, num_warps=self.warps,
            maxnreg=self.regs)
        check_resident(decode_layers_kernel, self.programs, self._sms, args, kw, self._resident,
                       "decode_layers")
        decode_layers_kernel[(self.programs,)](*args, **kw)
        return self.vec[:H].view(1, H)

    def unpack(self, f: int) -> torch.Tensor:
        """Phase f's weight (K, N) float32 as the kernel reads it: each unit's 16 word rows
        (tile_words' order undone; value j of a word in bits 4j, inputs 8r .. 8r + 7 of word
        row r) and its row of scales and zero points, dequantized as (q - zero) * scale
        (gate/up in the kernel's order)."""
        kind, base, _, total, groups, n = (int(v) for v in self.table[f, :6].tolist())
        if kind == ATTN:
            raise ValueError("decode_layers: an attention phase has no weight")
        tile = self.words.shape[1]
        tiles = total // groups
        words = unit_rows(self.words[base:base + 16 * total], tile)
        words = words.view(tiles, groups, 16, tile)
        shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
        q = (words[..., None] >> shifts) & 0xF  # (tiles, groups, 16, tile, 8)
        q = q.permute(0, 1, 2, 4, 3).reshape(tiles, groups * 128, tile)  # input 8r + j
        sz = self.sz_rows[base // 16:base // 16 + total].view(tiles, groups, tile // 4, 4)
        halves = torch.stack([sz & 0xFFFF, (sz >> 16) & 0xFFFF], -1)  # (.., quad, word, half)
        bf = halves.to(torch.int16).view(torch.bfloat16).float()
        scale = bf[..., :2, :].reshape(tiles, groups, tile)  # words 0, 1: channels 4q .. + 3
        zero = bf[..., 2:, :].reshape(tiles, groups, tile)
        w = (q.float().view(tiles, groups, 128, tile) - zero[:, :, None]) * scale[:, :, None]
        return w.reshape(tiles, groups * 128, tile).permute(1, 0, 2).reshape(groups * 128, n)

