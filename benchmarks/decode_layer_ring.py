"""One persistent kernel for a Llama decode step's int4 layers at batch 1, fed by a TMA ring.

The 4-bit weights stream through a ring of shared-memory chunks, and the whole layer is folded
into five phases, with its real work.

One program an SM. A producer warp copies the program's share of every projection's weight (the
tiled words of `ring_int4_probe.py`: a (tile of 32 channels a consumer warp, group of 128
inputs) unit a chunk, with the unit's row of scales and zero points beside it, `tile_scales`)
into a ring of shared-memory chunks, layer after layer, waiting only for a free chunk. The consumer warps (WARPS: 4 or 8, a tile of one or two heads) walk the phases; each
phase starts when every program has counted the phase before it done (a release add, polled
with acquire loads), and reads what that phase wrote through L2.

A layer's phases (the RMSNorms, RoPE and the K/V store, the attention merge, SiLU-and-mul and
the residual adds folded into the phases around them):

1. qkv. The input is xn = h * g (the input norm's weight) rounded to bf16, written by the phase
   that wrote h, with its tiles' sums of h^2; RMSNorm's 1 / rms is a scalar a row, so it
   scales the projection's sums at the end. A tile holds whole heads: its last piece scales,
   rounds, rotates q and k (the partner of channel c is c ^ 64, read from the same partials),
   and stores q, or k and v into the paged cache at the step's slot.
2. attention. KV heads x SPLITS programs each take a share of the context for the head's four
   query heads (online softmax, float32) and store (m, l, acc); the last split of a head to
   arrive merges them into the attention output (bf16).
3. o. The tile's last piece adds the residual: h = h + o (bf16), xn = h * g (the post-attention
   norm's weight), the tile's sum of h^2.
4. gate/up. The weight's channels are reordered so a tile's first half holds gate channels and
   its second half the same up channels; its last piece scales by 1 / rms and stores
   silu(gate) * up (bf16).
5. down. As o, with the next layer's input norm weight (the final norm's after the last layer).

A projection's units are shared out evenly over the programs (stream-K); each piece stores its
float32 partials and the last piece of a tile to arrive (a ticket) adds them in piece order and
does the tile's finish. Checked against `reference_layers` (torch, the same rounding points) on
the GPU; timed as CUDA-graph replays of 32 Llama-3-8B layers, in the forms `ring` (as above),
`ring_fold` (the attention programs make their q, k and v rows from the qkv phase's partials,
so the qkv tiles have no finish: a ticket, a read of the partials and a store less between the
two phases), `ring_traced` / `ring_fold_traced` (with %globaltimer stamps where each program's
wait ended and its phase ended: a mean timeline of the middle layers), `ring_free` (no waits
between phases: the stream and the phases' own work, the floor this design allows), and
`no_finishes` / `no_attention` (`ring` without the tiles' finishes / without attention's work);
the last three for their times only.

    python benchmarks/decode_layer_ring.py --out /tmp/out/decode_layer_ring.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_replay_ms, write_results  # noqa: E402
from benchmarks.ring_int4_probe import (_gemv_piece, _share, _tile_sum, share,  # noqa: E402
                                        tile_words)
from benchmarks.ring_stream_probe import _now, _poll, ring_barriers  # noqa: E402

V = gl.constexpr(2)
QKV, ATTN, O, GU, DOWN = 0, 1, 2, 3, 4  # a phase's kind (the table's first field)
K_QKV, K_ATTN, K_GU = gl.constexpr(QKV), gl.constexpr(ATTN), gl.constexpr(GU)
TABF = gl.constexpr(10)  # int64 fields a phase: kind, row base, units a program, units, groups,
#                          N, scale offset, input offset, norm weight offset, the layer's first
#                          cache slot
LOCKS = 256  # split-K tickets (tiles); the attention's follow
LOCKS_C = gl.constexpr(LOCKS)


@gluon.jit
def _rms(ss_ptr, c, H, eps, TILES_H: gl.constexpr):
    """1 / rms of h from the tiles' sums of squares."""
    sq = gl.load(ss_ptr + c, mask=c < TILES_H, other=0.0, cache_modifier=".cg")
    return gl.rsqrt(gl.sum(sq, 0) / H + eps)


@gluon.jit
def _finish(kind, j, n_pieces, N, part_ptr, vec_ptr, g_ptr, ss_ptr, cs_ptr, pos, slot,
            kc_ptr, vc_ptr, eps, H: gl.constexpr, HEADS: gl.constexpr, KVH: gl.constexpr,
            D: gl.constexpr, T: gl.constexpr, L: gl.constexpr):
    """Tile j's finish, once its sums are all in (see the module docstring): T channels (whole
    heads of D = 128), one a thread; a channel's RoPE partner is c ^ 64, a gate channel's up
    channel c + T / 2."""
    HALF: gl.constexpr = T // 2
    c = gl.arange(0, T, layout=L)
    n = j * T + c  # the projection's channel
    e = c % D  # the channel within its head
    y = _tile_sum(part_ptr, n_pieces, N, n)
    Q_OFF: gl.constexpr = 2 * H
    AT_OFF: gl.constexpr = Q_OFF + HEADS * D
    ACT_OFF: gl.constexpr = AT_OFF + HEADS * D
    if (kind == K_QKV) | (kind == K_GU):
        rr = _rms(ss_ptr, c, H, eps, H // T)
        if kind == K_QKV:
            partner = n + 64 - 2 * ((e // 64) * 64)  # n ^ 64
        else:
            partner = n + HALF - 2 * ((c // HALF) * HALF)  # gate <-> up
        y_p = _tile_sum(part_ptr, n_pieces, N, partner)
        y = (y * rr).to(gl.bfloat16).to(gl.float32)
        y_p = (y_p * rr).to(gl.bfloat16).to(gl.float32)
        if kind == K_QKV:
            head = n // D  # q heads, then k heads, then v heads; a tile holds one kind
            if j * T < (HEADS + KVH) * D:  # q or k: RoPE (rotate-half) at the step's position
                cos = gl.load(cs_ptr + pos * D + (e % 64))
                sin = gl.load(cs_ptr + pos * D + 64 + (e % 64))
                sign = gl.where(e < 64, -1.0, 1.0)
                r = (y * cos + sign * y_p * sin).to(gl.bfloat16)
                if j * T < HEADS * D:
                    gl.store(vec_ptr + Q_OFF + n, r)
                else:
                    gl.store(kc_ptr + (slot * KVH + (head - HEADS)) * D + e, r)
            else:
                gl.store(vc_ptr + (slot * KVH + (head - HEADS - KVH)) * D + e,
                         y.to(gl.bfloat16))
        else:  # gate channels in the tile's first half, the same up channels in its second
            act = y / (1.0 + gl.exp(-y)) * y_p
            gl.store(vec_ptr + ACT_OFF + j * HALF + c, act.to(gl.bfloat16), mask=c < HALF)
    else:  # o or down: the residual add, the next norm's input and the tile's sum of h^2
        y = y.to(gl.bfloat16).to(gl.float32)
        h = gl.load(vec_ptr + n, cache_modifier=".cg").to(gl.float32)
        hb = (h + y).to(gl.bfloat16)
        gl.store(vec_ptr + n, hb)
        hf = hb.to(gl.float32)
        gw = gl.load(g_ptr + n).to(gl.float32)
        gl.store(vec_ptr + H + n, (hf * gw).to(gl.bfloat16))
        gl.store(ss_ptr + j, gl.sum(hf * hf, 0))


@gluon.jit
def _attn_share(pid, pos, SPLITS: gl.constexpr):
    """KV head pid // SPLITS and its share [t0, t1) of the context 0 .. pos."""
    ctx = pos + 1
    per = (ctx + SPLITS - 1) // SPLITS
    t0 = gl.minimum((pid % SPLITS) * per, ctx)
    return pid // SPLITS, t0, gl.minimum(t0 + per, ctx)


@gluon.jit
def _attn_kv(kc_ptr, vc_ptr, bt_ptr, kh, tok, ok, KVH: gl.constexpr, D: gl.constexpr,
             BS: gl.constexpr, LK: gl.constexpr):
    """The K and V rows (bf16, (TB, D)) of tokens tok where ok, through the block table."""
    d = gl.arange(0, D, layout=gl.SliceLayout(0, LK))
    blk = gl.load(bt_ptr + tok // BS, mask=ok, other=0).to(gl.int64)
    row = ((blk * BS + tok % BS) * KVH + kh) * D
    addr = gl.expand_dims(row, 1) + gl.expand_dims(d, 0)
    okk = gl.expand_dims(ok, 1)
    kt = gl.load(kc_ptr + addr, mask=okk, other=0.0, cache_modifier=".cg")
    vt = gl.load(vc_ptr + addr, mask=okk, other=0.0, cache_modifier=".cg")
    return kt, vt


@gluon.jit
def _attn_early(pid, kc_ptr, vc_ptr, bt_ptr, pos, KVH: gl.constexpr, D: gl.constexpr,
                BS: gl.constexpr, SPLITS: gl.constexpr, TB: gl.constexpr,
                WARPS: gl.constexpr):
    """The K and V rows of the share's first TB tokens but this step's own (written by the qkv
    phase): earlier steps wrote them, so they are read before the wait for the qkv phase."""
    LK: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
    kh, t0, t1 = _attn_share(pid, pos, SPLITS)
    tok = t0 + gl.arange(0, TB, layout=gl.SliceLayout(1, LK))
    return _attn_kv(kc_ptr, vc_ptr, bt_ptr, kh, tok, (tok < t1) & (tok < pos), KVH, D, BS, LK)


@gluon.jit
def _attn_inputs(pid, vec_ptr, kc_ptr, vc_ptr, pos, slot, scale, H: gl.constexpr,
                 HEADS: gl.constexpr, KVH: gl.constexpr, D: gl.constexpr,
                 SPLITS: gl.constexpr, WARPS: gl.constexpr):
    """The head's four query rows (float32, scaled by scale * log2 e) as the qkv phase stored
    them, and this step's K and V rows (bf16) from the cache at its slot."""
    GQA: gl.constexpr = HEADS // KVH
    Q_OFF: gl.constexpr = 2 * H
    LD: gl.constexpr = gl.SliceLayout(0, gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0]))
    LOG2E: gl.constexpr = 1.4426950408889634
    kh = pid // SPLITS
    d = gl.arange(0, D, layout=LD)
    qa = vec_ptr + Q_OFF + kh * GQA * D + d
    q0 = gl.load(qa, cache_modifier=".cg").to(gl.float32) * (scale * LOG2E)
    q1 = gl.load(qa + D, cache_modifier=".cg").to(gl.float32) * (scale * LOG2E)
    q2 = gl.load(qa + 2 * D, cache_modifier=".cg").to(gl.float32) * (scale * LOG2E)
    q3 = gl.load(qa + 3 * D, cache_modifier=".cg").to(gl.float32) * (scale * LOG2E)
    cur = (slot * KVH + kh) * D + d
    k_cur = gl.load(kc_ptr + cur, cache_modifier=".cg")
    v_cur = gl.load(vc_ptr + cur, cache_modifier=".cg")
    return q0, q1, q2, q3, k_cur, v_cur


@gluon.jit
def _qkv_head(part_ptr, h, W, CHUNKS, N, rr, cs_ptr, pos, d, ROPE: gl.constexpr,
              T: gl.constexpr, D: gl.constexpr):
    """Head h of the qkv projection from its tile's partials, as the qkv finish makes it:
    scaled by 1 / rms, rounded, and (ROPE) rotated and rounded again; float32."""
    n0 = h * D
    j = n0 // T
    first = (j * CHUNKS) // W
    n_pieces = ((j + 1) * CHUNKS - 1) // W - first + 1
    y = (_tile_sum(part_ptr, n_pieces, N, n0 + d) * rr).to(gl.bfloat16).to(gl.float32)
    if ROPE:
        partner = d + 64 - 2 * ((d // 64) * 64)  # d ^ 64
        y_p = (_tile_sum(part_ptr, n_pieces, N, n0 + partner) * rr).to(gl.bfloat16)
        cos = gl.load(cs_ptr + pos * D + (d % 64))
        sin = gl.load(cs_ptr + pos * D + 64 + (d % 64))
        sign = gl.where(d < 64, -1.0, 1.0)
        y = (y * cos + sign * y_p.to(gl.float32) * sin).to(gl.bfloat16).to(gl.float32)
    return y


@gluon.jit
def _attn_inputs_folded(pid, part_ptr, ss_ptr, cs_ptr, vec_ptr, kc_ptr, vc_ptr, pos, slot, W,
                        CHUNKS, N, eps, scale, H: gl.constexpr, HEADS: gl.constexpr, KVH: gl.constexpr,
                        D: gl.constexpr, T: gl.constexpr, SPLITS: gl.constexpr,
                        WARPS: gl.constexpr):
    """As _attn_inputs, but made here from the qkv phase's partials (which then has no tile
    finish): the head's four query rows, and its K and V rows, which the share holding this
    step's token also stores into the cache at its slot."""
    GQA: gl.constexpr = HEADS // KVH
    LD: gl.constexpr = gl.SliceLayout(0, gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0]))
    LOG2E: gl.constexpr = 1.4426950408889634
    kh, t0, t1 = _attn_share(pid, pos, SPLITS)
    d = gl.arange(0, D, layout=LD)
    rr = _rms(ss_ptr, d, H, eps, H // T)
    q0 = _qkv_head(part_ptr, kh * GQA, W, CHUNKS, N, rr, cs_ptr, pos, d, True, T, D)
    q1 = _qkv_head(part_ptr, kh * GQA + 1, W, CHUNKS, N, rr, cs_ptr, pos, d, True, T, D)
    q2 = _qkv_head(part_ptr, kh * GQA + 2, W, CHUNKS, N, rr, cs_ptr, pos, d, True, T, D)
    q3 = _qkv_head(part_ptr, kh * GQA + 3, W, CHUNKS, N, rr, cs_ptr, pos, d, True, T, D)
    k_cur = _qkv_head(part_ptr, HEADS + kh, W, CHUNKS, N, rr, cs_ptr, pos, d, True, T,
                      D).to(gl.bfloat16)
    v_cur = _qkv_head(part_ptr, HEADS + KVH + kh, W, CHUNKS, N, rr, cs_ptr, pos, d, False, T,
                      D).to(gl.bfloat16)
    if (t0 <= pos) & (pos < t1):
        cur = (slot * KVH + kh) * D + d
        gl.store(kc_ptr + cur, k_cur)
        gl.store(vc_ptr + cur, v_cur)
        gl.thread_barrier()  # (read back by this program where the context is longer)
    if pid % SPLITS == 0:  # q as the qkv finish would have stored it (for checks only)
        qa = vec_ptr + 2 * H + kh * GQA * D + d
        gl.store(qa, q0.to(gl.bfloat16))
        gl.store(qa + D, q1.to(gl.bfloat16))
        gl.store(qa + 2 * D, q2.to(gl.bfloat16))
        gl.store(qa + 3 * D, q3.to(gl.bfloat16))
    return (q0 * (scale * LOG2E), q1 * (scale * LOG2E), q2 * (scale * LOG2E),
            q3 * (scale * LOG2E), k_cur, v_cur)


@gluon.jit
def _attention(pid, vec_ptr, kc_ptr, vc_ptr, bt_ptr, pos, q0, q1, q2, q3, k_cur, v_cur, kt0, vt0,
               apart_ptr, lock_ptr, H: gl.constexpr, HEADS: gl.constexpr, KVH: gl.constexpr,
               D: gl.constexpr, BS: gl.constexpr, SPLITS: gl.constexpr, TB: gl.constexpr,
               WARPS: gl.constexpr):
    """KV head pid // SPLITS, its share of the context 0 .. pos for the head's four query rows
    q0 .. q3 (the share's first TB tokens' K/V rows kt0, vt0 read early, this step's own rows
    k_cur, v_cur); the last share of a head to arrive merges the shares into the output."""
    GQA: gl.constexpr = HEADS // KVH
    Q_OFF: gl.constexpr = 2 * H
    AT_OFF: gl.constexpr = Q_OFF + HEADS * D
    LK: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
    LT: gl.constexpr = gl.SliceLayout(1, LK)
    LD: gl.constexpr = gl.SliceLayout(0, LK)
    kh, t0, t1 = _attn_share(pid, pos, SPLITS)
    sp = pid % SPLITS
    d = gl.arange(0, D, layout=LD)
    tt = gl.arange(0, TB, layout=LT)
    zd = gl.zeros([D], gl.float32, layout=LD)
    ninf = gl.max(gl.full([TB], float("-inf"), gl.float32, layout=LT), 0)
    fzero = gl.sum(gl.zeros([TB], gl.float32, layout=LT), 0)
    tok = t0 + tt
    ok = tok < t1
    here = gl.expand_dims(tok == pos, 1)
    kt = gl.where(here, gl.expand_dims(k_cur, 0), kt0).to(gl.float32)
    vt = gl.where(here, gl.expand_dims(v_cur, 0), vt0).to(gl.float32)
    m0, l0, a0 = _online(kt, vt, q0, ok, ninf, fzero, zd)
    m1, l1, a1 = _online(kt, vt, q1, ok, ninf, fzero, zd)
    m2, l2, a2 = _online(kt, vt, q2, ok, ninf, fzero, zd)
    m3, l3, a3 = _online(kt, vt, q3, ok, ninf, fzero, zd)
    for tb in range(t0 + TB, t1, TB):  # contexts longer than SPLITS * TB tokens
        tok = tb + tt
        ok = tok < t1
        kb, vb = _attn_kv(kc_ptr, vc_ptr, bt_ptr, kh, tok, ok, KVH, D, BS, LK)
        kt = kb.to(gl.float32)
        vt = vb.to(gl.float32)
        m0, l0, a0 = _online(kt, vt, q0, ok, m0, l0, a0)
        m1, l1, a1 = _online(kt, vt, q1, ok, m1, l1, a1)
        m2, l2, a2 = _online(kt, vt, q2, ok, m2, l2, a2)
        m3, l3, a3 = _online(kt, vt, q3, ok, m3, l3, a3)
    base = (kh * SPLITS + sp) * GQA
    _put(apart_ptr, base + 0, m0, l0, a0, d, D)
    _put(apart_ptr, base + 1, m1, l1, a1, d, D)
    _put(apart_ptr, base + 2, m2, l2, a2, d, D)
    _put(apart_ptr, base + 3, m3, l3, a3, d, D)
    gl.thread_barrier()
    ticket = gl.atomic_add(lock_ptr + kh, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLITS - 1:
        for h in gl.static_range(GQA):
            out = _merge(apart_ptr, kh * SPLITS * GQA + h, d, SPLITS, GQA, D)
            gl.store(vec_ptr + AT_OFF + (kh * GQA + h) * D + d, out.to(gl.bfloat16))
        gl.atomic_xchg(lock_ptr + kh, 0)


@gluon.jit
def _online(kt, vt, q, ok, m, l, acc):
    """One block of tokens for one query head: scores (log2 units), online softmax."""
    s = gl.sum(kt * gl.expand_dims(q, 0), 1)
    s = gl.where(ok, s, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, 0))
    alpha = gl.exp2(m - m_new)
    p = gl.exp2(s - m_new)
    l = l * alpha + gl.sum(p, 0)
    acc = acc * alpha + gl.sum(gl.expand_dims(p, 1) * vt, 0)
    return m_new, l, acc


@gluon.jit
def _put(apart_ptr, r, m, l, acc, d, D: gl.constexpr):
    """A share's (m, l) and acc for one query head: row r of the (m, l, acc) partials."""
    rec = apart_ptr + r * (D + 2)
    gl.store(rec + d, acc)
    gl.store(rec + D, m)
    gl.store(rec + D + 1, l)


@gluon.jit
def _merge(apart_ptr, r0, d, SPLITS: gl.constexpr, GQA: gl.constexpr, D: gl.constexpr):
    """The shares' (m, l, acc) of one query head merged: sum_s 2^(m_s - M) acc_s / sum_s
    2^(m_s - M) l_s."""
    big = gl.load(apart_ptr + r0 * (D + 2) + D, cache_modifier=".cg")
    for s in range(1, SPLITS):
        big = gl.maximum(big, gl.load(apart_ptr + (r0 + s * GQA) * (D + 2) + D,
                                      cache_modifier=".cg"))
    num = gl.zeros_like(d.to(gl.float32))
    den = gl.sum(num, 0)
    for s in range(SPLITS):
        rec = apart_ptr + (r0 + s * GQA) * (D + 2)
        w = gl.exp2(gl.load(rec + D, cache_modifier=".cg") - big)
        num += w * gl.load(rec + d, cache_modifier=".cg")
        den += w * gl.load(rec + D + 1, cache_modifier=".cg")
    return num / den


@gluon.jit
def _consumer(bufs, sbufs, ready, empty, tab_ptr, n_phases, s_ptr, z_ptr, vec_ptr, norm_ptr, ss_ptr,
              part_ptr, apart_ptr, lock_ptr, cnt_ptr, cs_ptr, step_ptr, bt_ptr, kc_ptr, vc_ptr,
              trace_ptr, eps, scale, P, S: gl.constexpr, WARPS: gl.constexpr, H: gl.constexpr,
              HEADS: gl.constexpr, KVH: gl.constexpr, D: gl.constexpr, BS: gl.constexpr,
              SPLITS: gl.constexpr, TB: gl.constexpr, WAIT: gl.constexpr, TRACE: gl.constexpr,
              X_AHEAD: gl.constexpr, SZ: gl.constexpr, SKIP: gl.constexpr,
              FOLD: gl.constexpr):
    T: gl.constexpr = 32 * WARPS
    L: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    LW: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, WARPS], [0, 1])
    LK: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
    pid = gl.program_id(0)
    idx = gl.arange(0, T, layout=L)
    lane = idx % 32
    g = lane // 4
    t = lane % 4
    sel = gl.where(t % 2 == 0, 0x4140, 0x4342)
    zero = gl.zeros([T], gl.float32, layout=L)
    ones = gl.full([T], 0x3F803F80, gl.int32, layout=L)
    pos = gl.load(step_ptr).to(gl.int64)
    slot = gl.load(step_ptr + 1).to(gl.int64)
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
        c_off = gl.load(tab_ptr + f * TABF + 9) * (KVH * D)  # the layer's cache
        if SKIP & 2 == 0:
            attn = (kind == K_ATTN) & (pid < KVH * SPLITS)
            kt0 = gl.zeros([TB, D], gl.bfloat16, layout=LK)
            vt0 = kt0
            if attn:  # the earlier steps' K/V rows need no wait
                kt0, vt0 = _attn_early(pid, kc_ptr + c_off, vc_ptr + c_off, bt_ptr, pos, KVH, D,
                                       BS, SPLITS, TB, WARPS)
        if WAIT and f > 0:  # every program of the phase before is done
            seen = _poll(cnt_ptr + (f - 1))
            while seen < P:
                seen = _poll(cnt_ptr + (f - 1))
        if TRACE:
            gl.store(trace_ptr + (f * P + pid) * 2, _now())
        if kind == K_ATTN:
            if SKIP & 2 == 0:
                if attn:
                    if FOLD:  # the qkv phase's W, groups and N
                        q_w = gl.load(tab_ptr + (f - 1) * TABF + 2).to(gl.int32)
                        q_c = gl.load(tab_ptr + (f - 1) * TABF + 4).to(gl.int32)
                        q_n = gl.load(tab_ptr + (f - 1) * TABF + 5).to(gl.int32)
                        q0, q1, q2, q3, k_cur, v_cur = _attn_inputs_folded(
                            pid, part_ptr, ss_ptr, cs_ptr, vec_ptr, kc_ptr + c_off, vc_ptr + c_off,
                            pos, slot, q_w, q_c, q_n, eps, scale, H, HEADS, KVH, D, T, SPLITS,
                            WARPS)
                    else:
                        q0, q1, q2, q3, k_cur, v_cur = _attn_inputs(
                            pid, vec_ptr, kc_ptr + c_off, vc_ptr + c_off, pos, slot, scale, H,
                            HEADS, KVH, D, SPLITS, WARPS)
                    _attention(pid, vec_ptr, kc_ptr + c_off, vc_ptr + c_off, bt_ptr, pos, q0, q1,
                               q2, q3, k_cur, v_cur, kt0, vt0, apart_ptr, lock_ptr + LOCKS_C, H,
                               HEADS, KVH, D, BS, SPLITS, TB, WARPS)
        else:
            x_base = vec_ptr.to(gl.int64) + x_off * 2
            start, end = _share(pid, W, total)
            u = start
            while u < end:
                i, done, j, n_pieces = _gemv_piece(
                    bufs, sbufs, ready, empty, i, u, end, CHUNKS, N, W, s_ptr, z_ptr, s_off,
                    x_base, part_ptr, pid, idx, t, g, zero, ones, sel, LW, L, T, S, X_AHEAD, SZ,
                    WARPS)
                u += done
                if FOLD:  # the attention phase finishes qkv's tiles itself
                    tiled = kind != K_QKV
                else:
                    tiled = kind >= 0
                if tiled:
                    # NOTE: every thread's partial stores come before the ticket (barrier), and
                    # the ticket is a gpu-scope acq_rel atomic, so the last piece sees all
                    # partials.
                    gl.thread_barrier()
                    ticket = gl.atomic_add(lock_ptr + j, 1, sem="acq_rel", scope="gpu")
                    if (ticket == n_pieces - 1) and (SKIP & 1 == 0):
                        _finish(kind, j, n_pieces, N, part_ptr, vec_ptr, norm_ptr + g_off, ss_ptr,
                                cs_ptr, pos, slot, kc_ptr + c_off, vc_ptr + c_off, eps, H, HEADS,
                                KVH, D, T, L)
                        gl.atomic_xchg(lock_ptr + j, 0)
        if TRACE:
            gl.store(trace_ptr + (f * P + pid) * 2 + 1, _now())
        gl.thread_barrier()
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
            tma.async_copy_global_to_shared(desc, [base + u * 16, 0], ready.index(slot),
                                            bufs.index(slot))
            if SZ:
                tma.async_copy_global_to_shared(sdesc, [base // 16 + u, 0], ready.index(slot),
                                                sbufs.index(slot))
            i += 1


@gluon.jit
def decode_layers_kernel(desc, sdesc, tab_ptr, n_phases, s_ptr, z_ptr, vec_ptr, norm_ptr, ss_ptr,
                         part_ptr, apart_ptr, lock_ptr, cnt_ptr, cs_ptr, step_ptr, bt_ptr,
                         kc_ptr, vc_ptr, trace_ptr, eps, scale, P, S: gl.constexpr,
                         WARPS: gl.constexpr, H: gl.constexpr, HEADS: gl.constexpr,
                         KVH: gl.constexpr, D: gl.constexpr, BS: gl.constexpr,
                         SPLITS: gl.constexpr, TB: gl.constexpr, WAIT: gl.constexpr = True,
                         TRACE: gl.constexpr = False, X_AHEAD: gl.constexpr = 4,
                         SZ: gl.constexpr = 1, SKIP: gl.constexpr = 0,
                         FOLD: gl.constexpr = 0):
    T: gl.constexpr = 32 * WARPS
    bufs = gl.allocate_shared_memory(gl.int32, [S, 16, T], desc.layout)
    sbufs = gl.allocate_shared_memory(gl.int32, [S, 1, T], sdesc.layout)
    ready, empty = ring_barriers(S)
    gl.warp_specialize([
        (_consumer, (bufs, sbufs, ready, empty, tab_ptr, n_phases, s_ptr, z_ptr, vec_ptr, norm_ptr,
                     ss_ptr, part_ptr, apart_ptr, lock_ptr, cnt_ptr, cs_ptr, step_ptr, bt_ptr,
                     kc_ptr, vc_ptr, trace_ptr, eps, scale, P, S, WARPS, H, HEADS, KVH, D, BS,
                     SPLITS, TB, WAIT, TRACE, X_AHEAD, SZ, SKIP, FOLD)),
        (_layer_producer, (desc, sdesc, bufs, sbufs, ready, empty, tab_ptr, n_phases, S, T,
                           SZ)),
    ], [1], [48])


# Llama-3-8B's shapes
LLAMA3_8B = {"H": 4096, "HEADS": 32, "KVH": 8, "D": 128, "INTER": 14336, "BS": 16,
             "theta": 500000.0, "eps": 1e-5}


def tile_scales(w, tile: int) -> torch.Tensor:
    """A layout's scales and zero points by (tile, group) unit, in tile_words' unit order:
    (units, tile) int32, a quad of channels 4q .. 4q + 3 at words 4q .. 4q + 3 as (s0, s1),
    (s2, s3), (z0, z1), (z2, z3), 16-bit pairs with the lower channel in the low half."""
    groups, n = w.scales.shape
    s32 = w.scales.contiguous().view(torch.int32).view(groups, n // 4, 2)
    z32 = w.zeros.contiguous().view(torch.int32).view(groups, n // 4, 2)
    sz = torch.cat([s32, z32], 2).reshape(groups, n // tile, tile)
    return sz.permute(1, 0, 2).reshape(-1, tile).contiguous()


def gate_up_order(inter: int, half: int = 64) -> torch.Tensor:
    """The gate/up weight's channel order in the kernel: tile j (2 * half channels) holds gate
    channels half * j .. half * (j + 1) - 1, then the same up channels (inter + half * j ..)."""
    gate = torch.arange(inter).view(-1, half)
    return torch.stack([gate, gate + inter], 1).reshape(-1)


def offsets(cfg: dict) -> dict:
    """Where each vector lives in the kernel's bf16 arena: h, xn, q, the attention output and
    silu(gate) * up."""
    h, qd = cfg["H"], cfg["HEADS"] * cfg["D"]
    return {"h": 0, "xn": h, "q": 2 * h, "attn": 2 * h + qd, "act": 2 * h + 2 * qd,
            "size": 2 * h + 2 * qd + cfg["INTER"]}


def build(layers: int, P: int, ctx: int, dev: torch.device, cfg: dict = LLAMA3_8B,
          seed: int = 0, warps: int = 4, sz: bool = True) -> dict:
    """Random 4-bit weights (scales, zero points), norm weights, a paged K/V cache holding ctx - 1
    tokens a layer, the step's position and slot, and the phase table (TABF int64 fields a
    phase) for P programs. sz: each chunk's group's scales and zero points travel with it by
    TMA (tile_scales), else the consumers read them from global memory."""
    from peregrine.layers.quantization.wna16 import WNA16Layout
    torch.manual_seed(seed)
    H, HEADS, KVH, D, INTER, BS = (cfg[k] for k in ("H", "HEADS", "KVH", "D", "INTER", "BS"))
    tile = 32 * warps
    if HEADS // KVH != 4 or D != 128 or tile % D or (KVH * D) % tile or H % tile \
            or INTER % (tile // 2):
        raise ValueError("decode_layer_ring: four query heads a KV head of 128 channels, and "
                         f"tiles of {tile} channels of whole heads")
    off = offsets(cfg)
    order = gate_up_order(INTER, tile // 2).to(dev)
    proj = ((QKV, H, (HEADS + 2 * KVH) * D), (O, HEADS * D, H), (GU, H, 2 * INTER),
            (DOWN, INTER, H))
    x_in = {QKV: off["xn"], O: off["attn"], GU: off["xn"], DOWN: off["act"]}
    blocks_a_layer = -(-ctx // BS) + 1
    layouts, tiled, sz_rows, scales, zeros, table = [], [], [], [], [], []
    row = s_off = 0
    for layer in range(layers):
        per = {}
        for kind, k, n in proj:
            q = torch.randint(0, 16, (k, n), device=dev, dtype=torch.int32)
            sc = torch.rand(k // 128, n, device=dev) * (2.0 / k) ** 0.5 / 4 + 1e-4
            zp = torch.randint(0, 16, (k // 128, n), device=dev).float()
            if kind == GU:
                q, sc, zp = q[:, order], sc[:, order], zp[:, order]
            w = WNA16Layout.build(q, sc, zp, None, 4, torch.bfloat16)
            del q
            per[kind] = w
            tiled.append(tile_words(w.qweight, tile))
            sz_rows.append(tile_scales(w, tile))
            scales.append(w.scales.reshape(-1))
            zeros.append(w.zeros.reshape(-1))
            groups, tiles = k // 128, n // tile
            if kind == O:
                table.append([ATTN, 0, 0, 0, 1, 0, 0, 0, 0, layer * blocks_a_layer * BS])
            g_off = {QKV: 2 * layer, O: 2 * layer + 1, GU: 0, DOWN: 2 * layer + 2}[kind] * H
            table.append([kind, row, share(tiles, groups, P), tiles * groups, groups, n, s_off,
                          x_in[kind], g_off, layer * blocks_a_layer * BS])
            row += tiles * groups * 16
            s_off += groups * n
        layouts.append(per)
    norms = (1.0 + 0.1 * torch.randn((2 * layers + 1) * H, device=dev)).to(torch.bfloat16)
    cache_shape = (layers * blocks_a_layer, BS, KVH, D)
    k_cache = torch.randn(cache_shape, device=dev).to(torch.bfloat16)
    v_cache = torch.randn(cache_shape, device=dev).to(torch.bfloat16)
    # a block table: the sequence's blocks, shuffled, within each layer's own blocks
    block_table = torch.randperm(blocks_a_layer, device=dev).to(torch.int32)
    pos = ctx - 1
    slot = int(block_table[pos // BS]) * BS + pos % BS
    inv = cfg["theta"] ** (-torch.arange(0, D, 2, device=dev, dtype=torch.float64) / D)
    ang = torch.arange(ctx, device=dev, dtype=torch.float64)[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], 1).float()
    h0 = torch.randn(H, device=dev).to(torch.bfloat16)
    return {"cfg": cfg, "layouts": layouts, "words": torch.cat(tiled),
            "scales": torch.cat(scales), "zeros": torch.cat(zeros), "norms": norms,
            "table": torch.tensor(table, dtype=torch.int64, device=dev), "k_cache": k_cache,
            "v_cache": v_cache, "block_table": block_table, "blocks_a_layer": blocks_a_layer,
            "pos": pos, "slot": slot, "cos_sin": cos_sin, "h0": h0, "order": order,
            "warps": warps, "sz": sz, "sz_rows": torch.cat(sz_rows)}


def _round(x: torch.Tensor) -> torch.Tensor:
    """Rounded to bf16, back in float32."""
    return x.to(torch.bfloat16).float()


def reference_layers(d: dict, rounding: bool = True) -> dict:
    """The kernel's layers in torch (float32 sums, the kernel's rounding points; without
    `rounding`, float32 throughout): the final h and xn, every layer's K/V rows at the step's
    slot, and the last layer's q, attention output and silu(gate) * up."""
    _rb = _round if rounding else (lambda x: x)
    cfg = d["cfg"]
    H, HEADS, KVH, D, INTER, BS = (cfg[k] for k in ("H", "HEADS", "KVH", "D", "INTER", "BS"))
    eps, pos, slot = cfg["eps"], d["pos"], d["slot"]
    norms = d["norms"].float().view(-1, H)
    cos, sin = d["cos_sin"][pos, :D // 2], d["cos_sin"][pos, D // 2:]
    h = d["h0"].float()
    ctx = pos + 1
    toks = torch.arange(ctx, device=h.device)
    slots = d["block_table"].long()[toks // BS] * BS + toks % BS
    ks, vs, qs, attns = [], [], [], []

    def rope(x):  # (heads, D)
        x1, x2 = x[:, :D // 2], x[:, D // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], 1)

    for layer, w in enumerate(d["layouts"]):
        rr = torch.rsqrt(h.pow(2).view(-1, 128).sum(1).sum() / H + eps)
        xn = _rb(h * norms[2 * layer])
        qkv = _rb((xn @ w[QKV].dequantize(torch.float32).t()) * rr)
        q = qkv[:HEADS * D].view(HEADS, D)
        k = qkv[HEADS * D:(HEADS + KVH) * D].view(KVH, D)
        v = qkv[(HEADS + KVH) * D:].view(KVH, D)
        q, k = _rb(rope(q)), _rb(rope(k))
        base = layer * d["blocks_a_layer"] * BS
        kc = d["k_cache"].view(-1, KVH, D)[base + slots].float().clone()
        vc = d["v_cache"].view(-1, KVH, D)[base + slots].float().clone()
        kc[-1], vc[-1] = k, v
        ks.append(k)
        vs.append(v)
        qs.append(q)
        kk = kc.repeat_interleave(HEADS // KVH, 1)  # (ctx, HEADS, D)
        vv = vc.repeat_interleave(HEADS // KVH, 1)
        att = torch.softmax(torch.einsum("hd,thd->ht", q, kk) / math.sqrt(D), -1)
        attn = _rb(torch.einsum("ht,thd->hd", att, vv).reshape(-1))
        attns.append(attn)
        o = _rb(attn @ w[O].dequantize(torch.float32).t())
        h = _rb(h + o)
        rr = torch.rsqrt(h.pow(2).view(-1, 128).sum(1).sum() / H + eps)
        xn = _rb(h * norms[2 * layer + 1])
        half = 16 * d["warps"]
        gu = _rb((xn @ w[GU].dequantize(torch.float32).t()) * rr).view(-1, 2, half)
        gate, up = gu[:, 0].reshape(-1), gu[:, 1].reshape(-1)
        act = _rb(gate / (1.0 + torch.exp(-gate)) * up)
        dn = _rb(act @ w[DOWN].dequantize(torch.float32).t())
        h = _rb(h + dn)
    return {"h": h, "xn": _rb(h * norms[2 * len(d["layouts"])]), "k": torch.stack(ks),
            "v": torch.stack(vs), "q": qs[-1], "attn": attns[-1], "act": act}


class Runner:
    """The kernel's buffers for one build, and the call that runs a step's layers."""

    def __init__(self, d: dict, P: int, stages: int = 16, splits: int = 16, tb: int = 16,
                 x_ahead: int = 4, regs: int = 128):
        cfg = d["cfg"]
        dev = d["words"].device
        self.d, self.P, self.cfg = d, P, cfg
        self.stages, self.splits, self.tb = stages, splits, tb
        self.wait, self.trace = True, False  # the phases' waits; timestamps (see timeline)
        self.skip = 0  # left out, for timing only: 1 the tiles' finishes, 2 attention's work
        self.fold = 0  # 1: the attention phase makes q, k and v from the qkv partials
        self.x_ahead, self.regs = x_ahead, regs  # x's steps ahead (4, 8); registers a thread
        self.off = offsets(cfg)
        H, D = cfg["H"], cfg["D"]
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        words = d["words"]
        self.warps = d["warps"]
        self.sz = int(d["sz"])
        self.desc = TensorDescriptor(words, list(words.shape), list(words.stride()),
                                     [16, 32 * self.warps], layout)
        rows = d["sz_rows"]
        self.sdesc = TensorDescriptor(rows, list(rows.shape), list(rows.stride()),
                                      [1, 32 * self.warps], layout)
        tab = d["table"]
        pieces = int(max(-(-r[4] // r[2]) + 1 for r in tab.tolist() if r[0] != ATTN))
        self.part = torch.empty(pieces * 2 * cfg["INTER"], dtype=torch.float32, device=dev)
        self.apart = torch.empty(cfg["KVH"] * splits * 4 * (D + 2), dtype=torch.float32,
                                 device=dev)
        self.lock = torch.zeros(LOCKS + cfg["KVH"], dtype=torch.int32, device=dev)
        self.cnt = torch.zeros(tab.shape[0], dtype=torch.int32, device=dev)
        self.vec = torch.zeros(self.off["size"], dtype=torch.bfloat16, device=dev)
        self.ss = torch.zeros(H // (32 * self.warps), dtype=torch.float32, device=dev)
        self.step = torch.tensor([d["pos"], d["slot"]], dtype=torch.int64, device=dev)
        self.g0 = d["norms"][:H].float()
        self.times = torch.zeros(tab.shape[0], P, 2, dtype=torch.int64, device=dev)
        if P < cfg["KVH"] * splits:
            raise ValueError(f"decode_layer_ring: {P} programs, fewer than the attention's "
                             f"{cfg['KVH'] * splits}")

    def __call__(self) -> None:
        cfg, d, H = self.cfg, self.d, self.cfg["H"]
        h0 = d["h0"]
        self.cnt.zero_()
        self.lock.zero_()  # (left at zero by a run with waits; not by one without)
        self.vec[:H].copy_(h0)
        self.vec[H:2 * H].copy_((h0.float() * self.g0).to(torch.bfloat16))
        self.ss.copy_(h0.float().pow(2).view(self.ss.numel(), -1).sum(1))
        decode_layers_kernel[(self.P,)](
            self.desc, self.sdesc, d["table"], d["table"].shape[0], d["scales"], d["zeros"],
            self.vec,
            d["norms"], self.ss, self.part, self.apart, self.lock, self.cnt, d["cos_sin"],
            self.step, d["block_table"], d["k_cache"], d["v_cache"], self.times, cfg["eps"],
            1.0 / math.sqrt(cfg["D"]), self.P, S=self.stages, WARPS=self.warps, H=H,
            HEADS=cfg["HEADS"], KVH=cfg["KVH"], D=cfg["D"], BS=cfg["BS"], SPLITS=self.splits,
            TB=self.tb, WAIT=self.wait, TRACE=self.trace, X_AHEAD=self.x_ahead, SZ=self.sz,
            SKIP=self.skip, FOLD=self.fold,
            num_warps=self.warps, maxnreg=self.regs)

    def state(self) -> dict:
        """The kernel's outputs, as reference_layers gives them."""
        cfg, d, off = self.cfg, self.d, self.off
        H, KVH, D = cfg["H"], cfg["KVH"], cfg["D"]
        layers = len(d["layouts"])
        rows = torch.arange(layers, device=self.vec.device) * d["blocks_a_layer"] * cfg["BS"] \
            + d["slot"]
        return {"h": self.vec[:H].float(), "xn": self.vec[H:2 * H].float(),
                "k": d["k_cache"].view(-1, KVH, D)[rows].float(),
                "v": d["v_cache"].view(-1, KVH, D)[rows].float(),
                "q": self.vec[off["q"]:off["attn"]].float().view(-1, D),
                "attn": self.vec[off["attn"]:off["act"]].float(),
                "act": self.vec[off["act"]:].float()}


def compare(got: dict, want: dict) -> dict:
    """Per output, the largest difference in bf16 ulps at the reference's magnitude (at least its
    RMS's), and the relative RMS difference."""
    out = {}
    for name, w in want.items():
        g = got[name]
        unit = torch.maximum(w.abs(), w.pow(2).mean().sqrt()) * 2.0 ** -8
        out[name] = {"max_ulps": round(((g - w).abs() / unit).max().item(), 2),
                     "rel_rms": float((g - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt())}
    return out


def timeline(times: torch.Tensor, per: int) -> list[dict]:
    """Per phase of a layer (the mean over the middle layers), in us from the layer's first
    phase's earliest start: when its programs' waits ended (first and last program) and when its
    last program ended."""
    layers = times.shape[0] // per
    t = times.double() / 1e3
    mid = range(layers // 4, max(layers - layers // 4, layers // 4 + 1))
    out = []
    for j in range(per):
        met_first = met_last = end_last = 0.0
        for layer in mid:
            t0 = t[layer * per, :, 0].min()
            f = layer * per + j
            met_first += float(t[f, :, 0].min() - t0)
            met_last += float(t[f, :, 0].max() - t0)
            end_last += float(t[f, :, 1].max() - t0)
        out.append({"met_first": round(met_first / len(mid), 2),
                    "met_last": round(met_last / len(mid), 2),
                    "end_last": round(end_last / len(mid), 2)})
    return out


# form: (the phases' waits, timestamps, what is left out: 1 the tiles' finishes, 2 attention's
# work (the last three forms' outputs are not the layers'), attention making q, k and v from the
# qkv partials)
FORMS = {"ring": (True, False, 0, 0), "ring_fold": (True, False, 0, 1),
         "ring_traced": (True, True, 0, 0), "ring_fold_traced": (True, True, 0, 1),
         "ring_free": (False, False, 0, 0), "no_finishes": (True, False, 1, 0),
         "no_attention": (True, False, 2, 0)}


def run(layers: int, ctx: int, warps: int, sz: bool, stages: list[int], splits: int,
        iters: int, forms: list[str], variants: list[tuple[int, int]],
        dev: torch.device) -> list[dict]:
    """For each ring depth and (x steps ahead, registers a thread): check the kernel against
    reference_layers, then time each form (CUDA-graph replays)."""
    P = torch.cuda.get_device_properties(dev).multi_processor_count
    t0 = time.time()
    d = build(layers, P, ctx, dev, warps=warps, sz=sz)
    want = reference_layers(d)
    wbytes = (d["words"].numel() + d["sz_rows"].numel()) * 4 / layers
    out = []
    for s in stages:
        r = Runner(d, P, s, splits)
        res = {"layers": layers, "ctx": ctx, "warps": warps, "scales_in_chunk": sz, "stages": s,
               "splits": splits, "programs": P, "wall_us_per_layer": round(wbytes / 4.2e6, 2),
               "variants": []}
        for x_ahead, regs in variants:
            r.x_ahead, r.regs = x_ahead, regs
            v = {"x_ahead": x_ahead, "regs": regs}
            for fold in (0, 1):
                r.wait, r.trace, r.skip, r.fold = True, False, 0, fold
                r()
                torch.cuda.synchronize()
                v["errors_fold" if fold else "errors"] = compare(r.state(), want)
            for name in forms:
                r.wait, r.trace, r.skip, r.fold = FORMS[name]
                ms = graph_replay_ms([r], iters)
                v[name] = round(ms * 1e3 / layers, 2)
                if name == "ring" and layers == 32:  # the LM head at the wall, ~30 us a step
                    v["est_tok_s"] = round(1e6 / (ms * 1e3 + 250 + 30), 1)
                if r.trace:
                    r()
                    torch.cuda.synchronize()
                    v[f"{name}_timeline"] = timeline(r.times.cpu(), 5)
            res["variants"].append(v)
            print(json.dumps(v), f"(layers {layers}, warps {warps}, scales in the chunk {sz}, "
                  f"ring {s}; {time.time() - t0:.0f} s)", flush=True)
        out.append(res)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", default="32", help="layer counts to check and time")
    p.add_argument("--ctx", type=int, default=256, help="tokens in the context, this one included")
    p.add_argument("--rings", default="4x16,4x26,8x8,8x13",
                   help="consumer warps x ring stages (chunks of 16 word rows of 32 channels a "
                   "warp), comma-separated")
    p.add_argument("--scales", default="chunk",
                   help="chunk (each chunk carries its scales) and/or global, comma-separated")
    p.add_argument("--splits", type=int, default=16)
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--variants", default="4x128,8x168",
                   help="x's steps ahead x registers a thread, comma-separated")
    p.add_argument("--iters", type=int, default=20)
    ns = p.parse_args()
    dev = torch.device("cuda")
    results = []
    variants = [tuple(int(v) for v in x.split("x")) for x in ns.variants.split(",")]
    rings: dict[int, list[int]] = {}
    for ring in ns.rings.split(","):
        w, s = (int(v) for v in ring.split("x"))
        rings.setdefault(w, []).append(s)
    for n in ns.layers.split(","):
        for sz in ns.scales.split(","):
            for w, stages in rings.items():
                results += run(int(n), ns.ctx, w, sz == "chunk", stages, ns.splits, ns.iters,
                               ns.forms.split(","), variants, dev)
            torch.cuda.empty_cache()
    write_results(ns.out, dev, results)


if __name__ == "__main__":
    main()


def unpack_phase(d: dict, f: int) -> torch.Tensor:
    """Phase f's weight (K, N) float32 as the kernel reads it: each unit's 16 word rows from the
    tiled words (value j of a word in bits 4j, inputs 8r .. 8r + 7 of word row r) and its row of
    scales and zero points (tile_scales), dequantized as (q - zero) * scale."""
    kind, base, _, total, groups, n = (int(v) for v in d["table"][f, :6].tolist())
    if kind == ATTN:
        raise ValueError("decode_layer_ring: an attention phase has no weight")
    tile = d["words"].shape[1]
    tiles = total // groups
    words = d["words"][base:base + 16 * total].view(tiles, groups, 16, tile)
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    q = (words[..., None] >> shifts) & 0xF  # (tiles, groups, 16, tile, 8)
    q = q.permute(0, 1, 2, 4, 3).reshape(tiles, groups * 128, tile)  # input 8r + j
    sz = d["sz_rows"][base // 16:base // 16 + total].view(tiles, groups, tile // 4, 4)
    halves = torch.stack([sz & 0xFFFF, (sz >> 16) & 0xFFFF], -1)  # (.., quad, word, half)
    bf = halves.to(torch.int16).view(torch.bfloat16).float()
    scale = bf[..., :2, :].reshape(tiles, groups, tile)  # words 0, 1: channels 4q .. 4q + 3
    zero = bf[..., 2:, :].reshape(tiles, groups, tile)
    w = (q.float().view(tiles, groups, 128, tile) - zero[:, :, None]) * scale[:, :, None]
    return w.reshape(tiles, groups * 128, tile).permute(1, 0, 2).reshape(groups * 128, n)
