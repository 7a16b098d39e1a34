"""Batch-1 paged decode attention as a phase of the persistent decode kernels (decode_layers.py,
decode_rows.py; Gluon, sm_90+): KV heads x SPLITS programs each take a share of the context for
the KV head's four query heads (online softmax in float32, log2 units; the earlier steps' K/V
rows read before the wait for the qkv phase, this step's own row after it), store (m, l, acc),
and the last share of a head to arrive merges them. Its inputs are the qkv phase's q and this step's
K/V row, or (`_attn_inputs_folded`) made here from the qkv projection's partials.

The row-tile kernel's share (`_mma_early`, `_mma_share`) does the same on tensor cores: the
block's K/V rows and the head's query rows (padded to 16) go into shared memory by cp.async
(the first block's earlier rows before the wait), S = Q K^T and O = P V are 16x8x16 MMAs with
the four warps taking a quarter of the block's tokens (S) and of the head dim (O), and p enters
P V as two bf16 parts (its rounding and the rest), so that the product keeps about 16 bits of
it. Its scores, softmax and partials are those of the float32 share, in another summation
order.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from peregrine.kernels._gluon import cp_async, cta_barrier
from peregrine.kernels.ring_gemv import _tile_sum


@gluon.jit
def _rms(ss_ptr, c, H, eps, TILES_H: gl.constexpr):
    """1 / rms of h from the tiles' sums of squares."""
    sq = gl.load(ss_ptr + c, mask=c < TILES_H, other=0.0, cache_modifier=".cg")
    return gl.rsqrt(gl.sum(sq, 0) / H + eps)


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
    cur = (gl.maximum(slot, 0) * KVH + kh) * D + d  # (a padding row, slot -1, reads slot 0)
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
    # (four pieces unrolled: six heads' sums are live at once here)
    y = (_tile_sum(part_ptr, n_pieces, N, n0 + d, UNROLL=4) * rr).to(gl.bfloat16).to(gl.float32)
    if ROPE:
        partner = d + 64 - 2 * ((d // 64) * 64)  # d ^ 64
        y_p = (_tile_sum(part_ptr, n_pieces, N, n0 + partner, UNROLL=4) * rr).to(gl.bfloat16)
        cos = gl.load(cs_ptr + pos * D + (d % 64))
        sin = gl.load(cs_ptr + pos * D + 64 + (d % 64))
        sign = gl.where(d < 64, -1.0, 1.0)
        y = (y * cos + sign * y_p.to(gl.float32) * sin).to(gl.bfloat16).to(gl.float32)
    return y


@gluon.jit
def _attn_inputs_folded(pid, part_ptr, ss_ptr, cs_ptr, vec_ptr, kc_ptr, vc_ptr, pos, slot, W,
                        CHUNKS, N, eps, scale, H: gl.constexpr, HEADS: gl.constexpr,
                        KVH: gl.constexpr, D: gl.constexpr, T: gl.constexpr, SPLITS: gl.constexpr,
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
    if (t0 <= pos) & (pos < t1) & (slot >= 0):
        cur = (slot * KVH + kh) * D + d
        gl.store(kc_ptr + cur, k_cur)
        gl.store(vc_ptr + cur, v_cur)
        cta_barrier()  # (read back by this program where the context is longer)
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
               WARPS: gl.constexpr, bs_ptr=None, XSUM: gl.constexpr = 0, rs_ptr=None,
               ROW_SUMS: gl.constexpr = 0):
    """KV head pid // SPLITS, its share of the context 0 .. pos for the head's four query rows
    q0 .. q3 (the share's first TB tokens' K/V rows kt0, vt0 read early, this step's own rows
    k_cur, v_cur); the last share of a head to arrive merges the shares into the output (XSUM:
    and stores its sums a block of 64 at bs_ptr, the arena's blocks' input sums; ROW_SUMS: and
    its sums a row of 8 at rs_ptr). Whether this share merged."""
    GQA: gl.constexpr = HEADS // KVH
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
    return _settle(kh, vec_ptr, apart_ptr, lock_ptr, H, HEADS, KVH, D, SPLITS, WARPS, bs_ptr,
                   XSUM, rs_ptr, ROW_SUMS)


@gluon.jit
def _settle(kh, vec_ptr, apart_ptr, lock_ptr, H: gl.constexpr, HEADS: gl.constexpr,
            KVH: gl.constexpr, D: gl.constexpr, SPLITS: gl.constexpr, WARPS: gl.constexpr,
            bs_ptr, XSUM: gl.constexpr, rs_ptr, ROW_SUMS: gl.constexpr):
    """A share's partials are stored: its ticket, and the last share of KV head kh to take one
    merges them all (_merge). Whether this share merged."""
    GQA: gl.constexpr = HEADS // KVH
    AT_OFF: gl.constexpr = 2 * H + HEADS * D
    cta_barrier()
    ticket = gl.atomic_add(lock_ptr + kh, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLITS - 1:
        if ROW_SUMS:
            _merge(apart_ptr, kh * SPLITS * GQA, vec_ptr + AT_OFF + kh * GQA * D, SPLITS, GQA,
                   D, WARPS, bs_ptr, XSUM, rs_ptr + kh * GQA * (D // 8), ROW_SUMS)
        else:
            _merge(apart_ptr, kh * SPLITS * GQA, vec_ptr + AT_OFF + kh * GQA * D, SPLITS, GQA,
                   D, WARPS, bs_ptr + (AT_OFF + kh * GQA * D) // 64, XSUM)
        gl.atomic_xchg(lock_ptr + kh, 0, sem="relaxed", scope="gpu")  # (see decode_layers._settle)
    return ticket == SPLITS - 1


# the tensor-core share (_mma_share): S = Q K^T and O = P V as 16x8x16 MMAs, the warps taking
# a quarter of the tokens (S) and of the head dim (O) each
@gluon.constexpr_function
def _mma_layout(warps):
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, warps],
                                     instr_shape=[16, 8])


@gluon.jit
def _stage_kv(k_s, v_s, kc_ptr, vc_ptr, bt_ptr, kh, t_lo, t_hi, KVH: gl.constexpr,
              D: gl.constexpr, BS: gl.constexpr, TB: gl.constexpr, WARPS: gl.constexpr):
    """cp.async of the K and V rows of tokens t_lo + i (i < TB) through the block table into
    rows i of k_s and v_s ((TB, D) bf16) where t_lo + i < t_hi, zeros in the others; one group."""
    LC: gl.constexpr = gl.BlockedLayout([1, 8], [256 // D, D // 8], [WARPS, 1], [1, 0])
    tok = t_lo + gl.arange(0, TB, layout=gl.SliceLayout(1, LC))
    ok = tok < t_hi
    d = gl.arange(0, D, layout=gl.SliceLayout(0, LC))
    blk = gl.load(bt_ptr + tok // BS, mask=ok, other=0).to(gl.int64)
    row = gl.multiple_of(((blk * BS + tok % BS) * KVH + kh) * D, D)
    addr = gl.expand_dims(row, 1) + gl.expand_dims(d, 0)
    okk = gl.expand_dims(ok, 1) & gl.expand_dims(d >= 0, 0)
    cp_async(k_s, kc_ptr + addr, mask=okk, cache_modifier=".cg")
    cp_async(v_s, vc_ptr + addr, mask=okk, cache_modifier=".cg")
    async_copy.commit_group()


@gluon.jit
def _mma_early(pid, k_s, v_s, kc_ptr, vc_ptr, bt_ptr, pos, KVH: gl.constexpr, D: gl.constexpr,
               BS: gl.constexpr, SPLITS: gl.constexpr, TB: gl.constexpr, WARPS: gl.constexpr):
    """The tensor-core share's first TB tokens' K and V rows but this step's own (earlier steps
    wrote them) into shared memory, before the wait for the qkv phase (in flight until
    _mma_share waits for them)."""
    kh, t0, t1 = _attn_share(pid, pos, SPLITS)
    _stage_kv(k_s, v_s, kc_ptr, vc_ptr, bt_ptr, kh, t0, gl.minimum(t1, pos), KVH, D, BS, TB,
              WARPS)


@gluon.jit
def _mma_block(q_s, k_s, v_s, tok0, t1, m, l, acc, scale_log2, TB: gl.constexpr,
               WARPS: gl.constexpr):
    """One block of tokens tok0 .. tok0 + TB (those below t1) for the 16 query rows in q_s:
    scores (log2 units) and online softmax in float32; p added to acc as two bf16 parts (its
    rounding and what the rounding left), so that P V keeps about 16 bits of p."""
    MS: gl.constexpr = _mma_layout(WARPS)
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MS, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MS, k_width=2)
    s = mma_v2(q_s.load(A_OP), k_s.permute((1, 0)).load(B_OP),
               gl.zeros([16, TB], gl.float32, layout=MS)) * scale_log2
    tok = tok0 + gl.arange(0, TB, layout=gl.SliceLayout(0, MS))
    s = gl.where(gl.expand_dims(tok < t1, 0), s, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, 1))
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)  # (-inf - -inf would be NaN)
    alpha = gl.exp2(m - m_sub)
    p = gl.exp2(s - gl.expand_dims(m_sub, 1))
    l = l * alpha + gl.sum(p, 1)
    hi = p.to(gl.bfloat16)
    lo = (p - hi.to(gl.float32)).to(gl.bfloat16)
    vb = v_s.load(B_OP)
    acc = acc * gl.expand_dims(alpha, 1)
    acc = mma_v2(gl.convert_layout(hi, A_OP), vb, acc)
    acc = mma_v2(gl.convert_layout(lo, A_OP), vb, acc)
    return m_new, l, acc


@gluon.jit
def _mma_share(pid, vec_ptr, kc_ptr, vc_ptr, bt_ptr, pos, slot, scale, q_s, k_s, v_s,
               apart_ptr, lock_ptr, H: gl.constexpr, HEADS: gl.constexpr, KVH: gl.constexpr,
               D: gl.constexpr, BS: gl.constexpr, SPLITS: gl.constexpr, TB: gl.constexpr,
               WARPS: gl.constexpr, bs_ptr=None, XSUM: gl.constexpr = 0, rs_ptr=None,
               ROW_SUMS: gl.constexpr = 0):
    """As _attention, on tensor cores, after the wait for the qkv phase (_mma_early copied the
    first block's earlier rows): the head's query rows (GQA of 16 rows, the others zeros) and
    every block of K and V through shared memory (q_s (16, D), k_s and v_s (TB, D), bf16)."""
    GQA: gl.constexpr = HEADS // KVH
    Q_OFF: gl.constexpr = 2 * H
    LOG2E: gl.constexpr = 1.4426950408889634
    MS: gl.constexpr = _mma_layout(WARPS)
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [256 // D, D // 8], [WARPS, 1], [1, 0])
    kh, t0, t1 = _attn_share(pid, pos, SPLITS)
    sp = pid % SPLITS
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, LQ))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
    q_at = vec_ptr + Q_OFF + kh * GQA * D + gl.expand_dims(r, 1) * D + gl.expand_dims(dq, 0)
    async_copy.wait_group(0)  # (block 0's earlier rows)
    cp_async(q_s, q_at, mask=gl.expand_dims(r < GQA, 1) & gl.expand_dims(dq >= 0, 0),
             cache_modifier=".cg")
    async_copy.commit_group()
    if (pos >= t0) & (pos < t1) & (pos < t0 + TB):
        # this step's own row is in block 0: the block again, now with it (each thread copies
        # the elements it copied early, whose zeros in that row landed at its wait before)
        _stage_kv(k_s, v_s, kc_ptr, vc_ptr, bt_ptr, kh, t0, t1, KVH, D, BS, TB, WARPS)
    async_copy.wait_group(0)
    cta_barrier()
    scale_log2 = scale * LOG2E
    m = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MS))
    l = gl.zeros([16], gl.float32, layout=gl.SliceLayout(1, MS))
    acc = gl.zeros([16, D], gl.float32, layout=MS)
    m, l, acc = _mma_block(q_s, k_s, v_s, t0, t1, m, l, acc, scale_log2, TB, WARPS)
    for tb in range(t0 + TB, t1, TB):  # contexts longer than SPLITS * TB tokens
        cta_barrier()  # (every warp's reads of the block before)
        _stage_kv(k_s, v_s, kc_ptr, vc_ptr, bt_ptr, kh, tb, t1, KVH, D, BS, TB, WARPS)
        async_copy.wait_group(0)
        cta_barrier()
        m, l, acc = _mma_block(q_s, k_s, v_s, tb, t1, m, l, acc, scale_log2, TB, WARPS)
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, MS))
    dd = gl.arange(0, D, layout=gl.SliceLayout(0, MS))
    rec = apart_ptr + ((kh * SPLITS + sp) * GQA + rows) * (D + 2)
    ok = rows < GQA
    gl.store(gl.expand_dims(rec, 1) + gl.expand_dims(dd, 0), acc,
             mask=gl.expand_dims(ok, 1) & gl.expand_dims(dd >= 0, 0))
    gl.store(rec + D, m, mask=ok)
    gl.store(rec + D + 1, l, mask=ok)
    return _settle(kh, vec_ptr, apart_ptr, lock_ptr, H, HEADS, KVH, D, SPLITS, WARPS, bs_ptr,
                   XSUM, rs_ptr, ROW_SUMS)


@gluon.jit
def _online(kt, vt, q, ok, m, l, acc):
    """One block of tokens for one query head: scores (log2 units), online softmax (a block
    with no token, an empty share's, leaves m at -inf and l and acc at 0)."""
    s = gl.sum(kt * gl.expand_dims(q, 0), 1)
    s = gl.where(ok, s, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, 0))
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)  # (-inf - -inf would be NaN)
    alpha = gl.exp2(m - m_sub)
    p = gl.exp2(s - m_sub)
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
def _merge(apart_ptr, r0, out_ptr, SPLITS: gl.constexpr, GQA: gl.constexpr, D: gl.constexpr,
           WARPS: gl.constexpr, bs_ptr=None, XSUM: gl.constexpr = 0, rs_ptr=None,
           ROW_SUMS: gl.constexpr = 0):
    """The shares' (m, l, acc) of a KV head's GQA = 4 query heads (rows r0 + s * GQA + h of
    the partials) merged and stored (bf16) at out_ptr, a query head a warp (or two): sum_s
    2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, the maximum M kept as the shares come (share 0
    holds a token, so M starts finite; an empty share's m is -inf and weighs 0). Every share's
    loads are independent of the sums, so they are in flight together: one round trip, where
    a pass for the maximum and a pass for the sums, head after head, took eight."""
    LM: gl.constexpr = gl.BlockedLayout([1, 16 // WARPS], [1, 32], [GQA, WARPS // GQA], [1, 0])
    hq = gl.arange(0, GQA, layout=gl.SliceLayout(1, LM))
    dd = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, LM)), 0)
    rec = apart_ptr + (r0 + hq) * (D + 2)
    big = gl.load(rec + D, cache_modifier=".cg")
    den = gl.load(rec + D + 1, cache_modifier=".cg")
    num = gl.load(gl.expand_dims(rec, 1) + dd, cache_modifier=".cg")
    for s in gl.static_range(1, SPLITS):
        rec = apart_ptr + (r0 + s * GQA + hq) * (D + 2)
        m_s = gl.load(rec + D, cache_modifier=".cg")
        l_s = gl.load(rec + D + 1, cache_modifier=".cg")
        a_s = gl.load(gl.expand_dims(rec, 1) + dd, cache_modifier=".cg")
        top = gl.maximum(big, m_s)
        c = gl.exp2(big - top)
        w = gl.exp2(m_s - top)
        num = num * gl.expand_dims(c, 1) + a_s * gl.expand_dims(w, 1)
        den = den * c + w * l_s
        big = top
    out = (num / gl.expand_dims(den, 1)).to(gl.bfloat16)
    gl.store(out_ptr + gl.expand_dims(hq, 1) * D + dd, out)
    if ROW_SUMS:  # (the sums a row of 8)
        rows = gl.sum(gl.reshape(out.to(gl.float32), [GQA, D // 8, 8]), 2)
        LR: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [GQA, WARPS // GQA], [1, 0])
        rows = gl.convert_layout(rows, LR)
        rr = gl.expand_dims(gl.arange(0, GQA, layout=gl.SliceLayout(1, LR)), 1) * (D // 8)
        gl.store(rs_ptr + rr + gl.expand_dims(gl.arange(0, D // 8, layout=gl.SliceLayout(0, LR)),
                                              0), rows)
    if XSUM:  # (each head's sums, a block of 64 at a time: the o phase's input sums)
        f = out.to(gl.float32)
        for b in gl.static_range(D // 64):
            gl.store(bs_ptr + hq * (D // 64) + b, gl.sum(gl.where(dd // 64 == b, f, 0.0), 1))
