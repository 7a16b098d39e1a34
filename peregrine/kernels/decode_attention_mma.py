"""The paged decode split kernel for FP8 caches on tensor cores, with every operand in registers.

One warp per (sequence, kv head, split) program, written in Gluon (Triton's explicit-layout
dialect) because the point is where each byte sits: the K and V tiles are read as 32-bit words
of four FP8 values by the very lanes, into the very registers, that the 16x8x16 tensor-core MMA
reads them from, so no byte moves between lanes. By default the words travel through a few
shared-memory stages first (cp.async, each lane copying and then reading back its own words),
so that tiles in flight hold no registers; they can also be loaded straight into registers.

    scores  S (16 q rows, 16 tokens)  = Q (16, D) . K^T (D, 16)      q heads padded to 16 rows
    output  O^T (D, 8 q heads)        = V^T (D, 16) . P^T (16, 8)    P^T is S's registers as is

What makes the loads land in operand registers: a dot product does not care in which order its
d terms are summed, and the output's d order is undone when it is stored. So each operand's "d"
is a permutation of the cache's d chosen to fit the MMA's register fragments:
  - K (the B operand of S): lane 4g + c holds token g of each 8-token column block and the
    k indices 2c, 2c+1, 2c+8, 2c+9 of each 16-wide step. Mapping step s, half r, pair i to the
    cache's d = c*D/4 + 4s + 2r + i gives each lane D/4 contiguous bytes of one token row (two
    16-byte loads at D = 128), and q is loaded once in the same permuted order.
  - V (the A operand of O^T): lane 4g + c holds tokens 2c, 2c+1 (and +8) and rows g, g+8 of each
    16-row step. Mapping row 16m + 8r + g to d = g*D/8 + 2m + r gives each lane D/8 contiguous
    bytes of four token rows. The MMA wants the two tokens' values of one d in one register,
    so a pair of words (tokens 2c and 2c+1) becomes four such registers by two byte permutes
    (prmt) and four packed conversions.
  - P^T (the B operand of O^T) is S's accumulator registers unchanged: a lane holds S[g][2c+i]
    and S[g][8+2c+i], which are exactly B's [k = 2c+i (+8)][n = g] (rows >= 8 are dropped, so a
    kv head may have at most 8 q heads).
FP8 -> fp16 is exact (cvt.rn.f16x2.e4m3x2, sm_89+); products accumulate in fp32; p is rounded to
fp16 for the P.V MMA, as in the tensor-core variants of decode_attention. The kernel writes the
same partial outputs and log-sum-exps as decode_attention's split kernel, whose merge kernel
finishes the job. Gluon kernels do not run on the Triton interpreter: this one runs on CUDA
GPUs only (usable() says where), and GPU tests check it against the reference.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from peregrine.kernels._gluon import cp_async, cta_barrier, pdl_wait
from peregrine.kernels._utils import FP8_DTYPES, has_fp8_convert

HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 8  # q heads per kv head: P^T keeps S's first 8 rows
BLOCK_N = 16  # tokens per tile; a tile lies inside one cache block


def usable(q: torch.Tensor, cache: torch.Tensor, group: int, block_size: int) -> str | None:
    """None where the kernel can run these shapes; else why not (for an error message)."""
    if not has_fp8_convert(q.device):
        return "a CUDA GPU with FP8 conversions (sm_89 or later)"
    if cache.dtype not in FP8_DTYPES:
        return f"an FP8 cache, got {cache.dtype}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"a 16-bit query, got {q.dtype}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"a head dim in {HEAD_DIMS}, got {q.shape[-1]}"
    if not 1 <= group <= MAX_GROUP:
        return f"at most {MAX_GROUP} q heads per kv head, got {group}"
    if block_size % BLOCK_N:
        return f"a cache block size that is a multiple of {BLOCK_N}, got {block_size}"
    return None


@gluon.constexpr_function
def _log2(x):
    return int(x).bit_length() - 1


@gluon.constexpr_function
def _v_chunk(head_dim):
    """Bytes of a V token row one lane reads in one piece (16, or D/8 when that is less)."""
    return min(16, head_dim // 8)


@gluon.constexpr_function
def _k_layout(block_n, head_dim):
    """K bytes as (token, word, byte), (BN, D/4, 4): lane 4g + c holds tokens 8j + g and, of
    every 64-byte piece of their rows, bytes 16c .. 16c + 15; a thread's registers run over
    bytes, words, pieces, then j. (One load instruction reads whole 64-byte spans of 8 rows.)"""
    reg = ([[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0]]
           + [[0, 16 << b, 0] for b in range(_log2(head_dim // 64))]
           + [[8 << b, 0, 0] for b in range(_log2(block_n // 8))])
    lane = [[0, 4, 0], [0, 8, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    return gl.DistributedLinearLayout(reg, lane, [], [], [block_n, head_dim // 4, 4])


@gluon.constexpr_function
def _v_layout(block_n, head_dim):
    """V bytes as (token, word, byte): lane 4g + c holds tokens 16t + 8r + 2c + i and, of every
    8 * chunk-byte piece of their rows, bytes chunk*g .. chunk*g + chunk - 1 (_v_chunk);
    registers run over i first (the token pair one MMA register holds), then bytes, words,
    pieces, r, t."""
    w = _v_chunk(head_dim) // 4
    reg = ([[1, 0, 0], [0, 0, 1], [0, 0, 2]] + [[0, 1 << b, 0] for b in range(_log2(w))]
           + [[0, (8 * w) << b, 0] for b in range(_log2(head_dim // 32 // w))]
           + [[8, 0, 0]] + [[16 << b, 0, 0] for b in range(_log2(block_n // 16))])
    lane = [[2, 0, 0], [4, 0, 0], [0, w, 0], [0, 2 * w, 0], [0, 4 * w, 0]]
    return gl.DistributedLinearLayout(reg, lane, [], [], [block_n, head_dim // 4, 4])


@gluon.constexpr_function
def _v_load_layout(block_n, head_dim):
    """V words (BN, D/4): the words of _v_layout, a lane's contiguous words first in its
    registers so that they load as one vector."""
    w = _v_chunk(head_dim) // 4
    reg = ([[0, 1 << b] for b in range(_log2(w))]
           + [[0, (8 * w) << b] for b in range(_log2(head_dim // 32 // w))]
           + [[1, 0], [8, 0]] + [[16 << b, 0] for b in range(_log2(block_n // 16))])
    lane = [[2, 0], [4, 0], [0, w], [0, 2 * w], [0, 4 * w]]
    return gl.DistributedLinearLayout(reg, lane, [], [], [block_n, head_dim // 4])


@gluon.constexpr_function
def _k_cvt_asm(e5m2):
    """PTX: a word's bytes 0, 1 and 2, 3 as two fp16 pairs."""
    f = "e5m2x2" if e5m2 else "e4m3x2"
    return ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            f"cvt.rn.f16x2.{f} $0, lo; cvt.rn.f16x2.{f} $1, hi; }}")


@gluon.constexpr_function
def _v_cvt_asm(e5m2):
    """PTX: words a, b ($4, $5) as the fp16 pairs (a0, b0), (a1, b1), (a2, b2), (a3, b3)."""
    f = "e5m2x2" if e5m2 else "e4m3x2"
    return ("{ .reg .b32 p, q; .reg .b16 p0, p1, q0, q1; "
            "prmt.b32 p, $4, $5, 0x5140; prmt.b32 q, $4, $5, 0x7362; "
            "mov.b32 {p0, p1}, p; mov.b32 {q0, q1}, q; "
            f"cvt.rn.f16x2.{f} $0, p0; cvt.rn.f16x2.{f} $1, p1; "
            f"cvt.rn.f16x2.{f} $2, q0; cvt.rn.f16x2.{f} $3, q1; }}")


@gluon.jit
def _k_words_to_f16(w4, E5M2: gl.constexpr):
    """(BN, D/4, 4) copies of each K word -> its bytes 0..3 as fp16 (two packed conversions)."""
    return gl.inline_asm_elementwise(_k_cvt_asm(E5M2), "=r,=r,r,r,r,r", [w4], dtype=gl.float16,
                                     is_pure=True, pack=4)


@gluon.jit
def _v_words_to_f16(w8, E5M2: gl.constexpr):
    """Copies of the words a, b of tokens 2c, 2c+1 (a, b, a, b, ...) -> fp16 registers holding
    (a0, b0), (a1, b1), (a2, b2), (a3, b3): two byte permutes, four packed conversions."""
    return gl.inline_asm_elementwise(_v_cvt_asm(E5M2), "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [w8],
                                     dtype=gl.float16, is_pure=True, pack=8)


@gluon.jit
def _block_of(bt_row, n0, end, BLOCK_SIZE: gl.constexpr):
    """The cache block holding the tile at token n0; for a tile past the end, the last tile's
    (whose K rows, just read, come from L2 again instead of from memory)."""
    return gl.load(bt_row + gl.minimum(n0, end - 1) // BLOCK_SIZE).to(gl.int64)


@gluon.jit
def _load_tile(k_words_ptr, v_words_ptr, blk, n0, end, k_lane, v_lane, v_tok,
               stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s, BLOCK_SIZE: gl.constexpr):
    """The raw K and V words of the tile at token n0, in cache block blk. V past the end is
    zeros (an unwritten slot may hold NaN bits, and nothing is read); K is read anyway (see
    _block_of) and its scores are masked by the caller."""
    slot = n0 % BLOCK_SIZE
    k = gl.load(k_words_ptr + (blk * stride_kc_b + slot * stride_kc_s) + k_lane)
    v = gl.load(v_words_ptr + (blk * stride_vc_b + slot * stride_vc_s) + v_lane,
                mask=(n0 + v_tok < end)[:, None], other=0)
    return k, v


@gluon.jit
def _copy_tile(k_stage, v_stage, k_words_ptr, v_words_ptr, blk, n0, end, k_lane, v_lane, v_tok,
               stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s, BLOCK_SIZE: gl.constexpr):
    """_load_tile's words copied into shared memory stages without passing through registers
    (cp.async: V past the end is zero-filled), as one commit group."""
    slot = n0 % BLOCK_SIZE
    cp_async(k_stage, k_words_ptr + (blk * stride_kc_b + slot * stride_kc_s) + k_lane)
    cp_async(v_stage, v_words_ptr + (blk * stride_vc_b + slot * stride_vc_s) + v_lane,
             mask=(n0 + v_tok < end)[:, None])
    async_copy.commit_group()


# The split kernels' int arguments that change with the batch: not specialised on (==1, %16),
# since each new value would compile a variant on the request path.
BATCH_VARYING_ARGS = ["min_split_len", "window", "stride_bt", "stride_mo_b", "stride_mo_h",
                      "stride_ml_b", "stride_ml_h"]


@gluon.jit(do_not_specialize=BATCH_VARYING_ARGS)
def decode_split_mma_kernel(
    q_ptr, k_words_ptr, v_words_ptr, block_table_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    scale_log2, min_split_len, window,
    stride_qb, stride_qh,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    stride_bt,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    o_ptr, v_scale, stride_ob, stride_oh,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, HAS_WINDOW: gl.constexpr, HEADS_FIRST: gl.constexpr,
    KV_E5M2: gl.constexpr, PREFETCH: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
    PDL: gl.constexpr,
):
    """decode_attention's split stage for FP8 caches read as int32 words (strides in words),
    one warp a program; the same grid, arguments and outputs as its "fma" variant. STAGES > 1:
    tiles are copied into that many shared-memory stages, STAGES - 1 tiles ahead of the one
    computed, without holding registers while in flight; else PREFETCH: the next tile's words
    are loaded into registers before the current tile is computed. DIRECT (one split a
    sequence): the output itself is written to o_ptr, times v_scale, in o_ptr's dtype, and an
    empty sequence's rows are zeros; the merge does not run."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                  instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    K4: gl.constexpr = _k_layout(BLOCK_N, HEAD_DIM)
    KW: gl.constexpr = gl.SliceLayout(2, K4)
    V4: gl.constexpr = _v_layout(BLOCK_N, HEAD_DIM)
    VW: gl.constexpr = gl.SliceLayout(2, V4)
    VL: gl.constexpr = _v_load_layout(BLOCK_N, HEAD_DIM)
    Q_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, 1], [1, 0])
    WORDS: gl.constexpr = HEAD_DIM // 4
    CHUNK: gl.constexpr = _v_chunk(HEAD_DIM)
    PIECES: gl.constexpr = HEAD_DIM // (8 * CHUNK)

    pdl_wait(PDL)
    if HEADS_FIRST:
        kvh = gl.program_id(0)
        b = gl.program_id(1)
    else:
        b = gl.program_id(0)
        kvh = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(seq_lens_ptr + b)
    # the split rule of decode_attention._seq_split_len
    split_len = gl.maximum(gl.cdiv(gl.cdiv(seq_len, gl.num_programs(2)), BLOCK_N) * BLOCK_N,
                           min_split_len)
    start = split * split_len
    heads = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    row = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, MMA))
    e = (row >> 4) * 2 + ((row >> 3) & 1)  # row 16m + 8r + g: byte e = 2m + r of lane g
    d_out = (e // CHUNK) * (8 * CHUNK) + (row & 7) * CHUNK + e % CHUNK
    hq = kvh * GROUP + heads
    b64 = b.to(gl.int64)
    if DIRECT:
        o_rows = o_ptr + b64 * stride_ob + hq[None, :] * stride_oh + d_out[:, None]
    if start >= seq_len:  # NOTE: splits past the context exit; the merge derives how many ran
        if DIRECT:  # an empty (padding) sequence
            gl.store(o_rows, gl.zeros([HEAD_DIM, 8], gl.float32, layout=MMA).to(
                o_ptr.dtype.element_ty), mask=(heads < GROUP)[None, :])
        return
    end = gl.minimum(start + split_len, seq_len)
    if HAS_WINDOW:
        start = gl.maximum(start, seq_len - window)
    lo = start  # the first key attended to; tiles start on a multiple of BLOCK_N
    start = start - start % BLOCK_N
    bt_row = block_table_ptr + b64 * stride_bt

    # q (16 rows, the GROUP real ones first) in K's permuted order: column 16s + 8r + 2c + i
    # holds d = 64p + 16c + 4w + 2r + i with s = 4p + w. A bf16 query beyond the fp16 range is
    # clamped.
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, Q_L))
    col = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, Q_L))
    dq = ((col >> 6) * 64 + ((col >> 1) & 3) * 16 + ((col >> 4) & 3) * 4
          + ((col >> 3) & 1) * 2 + (col & 1))
    q = gl.load(q_ptr + b64 * stride_qb + (kvh * GROUP + rows)[:, None] * stride_qh
                + dq[None, :], mask=(rows < GROUP)[:, None], other=0.0)
    q = gl.minimum(gl.maximum(q.to(gl.float32), -65504.0), 65504.0).to(gl.float16)
    q_op = gl.convert_layout(q, A_OP)

    # each lane's word offsets inside a tile: the same for every tile
    tk = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, KW))
    wk = gl.arange(0, WORDS, layout=gl.SliceLayout(0, KW))
    k_lane = (tk * stride_kc_s + kvh * stride_kc_h)[:, None] + wk[None, :]
    tv = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, VL))
    wv = gl.arange(0, WORDS, layout=gl.SliceLayout(0, VL))
    v_lane = (tv * stride_vc_s + kvh * stride_vc_h)[:, None] + wv[None, :]

    # NOTE: -1e30 (not -inf) keeps rows that saw no key free of NaN.
    m_i = gl.full([16], -1.0e30, gl.float32, layout=gl.SliceLayout(1, MMA))  # log2 units
    l_i = gl.zeros([16], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc = gl.zeros([HEAD_DIM, 8], gl.float32, layout=MMA)  # O^T in V's permuted d order
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))

    # NOTE: a tile's block id is loaded one tile before its words, and (PREFETCH, STAGES) its
    # words before they are used: no load waits on a load issued in the same iteration.
    blk_next = _block_of(bt_row, start, end, BLOCK_SIZE)
    if STAGES > 1:
        SMEM: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
        k_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, WORDS], SMEM)
        v_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, WORDS], SMEM)
        for j in gl.static_range(STAGES - 1):
            _copy_tile(k_smem.index(j), v_smem.index(j), k_words_ptr, v_words_ptr, blk_next,
                       start + j * BLOCK_N, end, k_lane, v_lane, tv, stride_kc_b, stride_kc_s,
                       stride_vc_b, stride_vc_s, BLOCK_SIZE)
            blk_next = _block_of(bt_row, start + (j + 1) * BLOCK_N, end, BLOCK_SIZE)
    elif PREFETCH:
        k_next, v_next = _load_tile(k_words_ptr, v_words_ptr, blk_next, start, end, k_lane,
                                    v_lane, tv, stride_kc_b, stride_kc_s, stride_vc_b,
                                    stride_vc_s, BLOCK_SIZE)
        blk_next = _block_of(bt_row, start + BLOCK_N, end, BLOCK_SIZE)
    for n0 in range(start, end, BLOCK_N):
        if STAGES > 1:
            tile = (n0 - start) // BLOCK_N
            ahead = n0 + (STAGES - 1) * BLOCK_N
            stage = (tile + STAGES - 1) % STAGES
            _copy_tile(k_smem.index(stage), v_smem.index(stage), k_words_ptr, v_words_ptr,
                       blk_next, ahead, end, k_lane, v_lane, tv, stride_kc_b, stride_kc_s,
                       stride_vc_b, stride_vc_s, BLOCK_SIZE)
            blk_next = _block_of(bt_row, ahead + BLOCK_N, end, BLOCK_SIZE)
            async_copy.wait_group(STAGES - 1)  # this tile's copies have landed
            cta_barrier()  # ... and every lane's are visible
            # NOTE: the stage overwritten next iteration is this one: its words are in
            # registers before any later instruction of this (single) warp issues.
            k_cur = k_smem.index(tile % STAGES).load(KW)
            v_cur = v_smem.index(tile % STAGES).load(VL)
        elif PREFETCH:
            k_cur = k_next
            v_cur = v_next
            k_next, v_next = _load_tile(k_words_ptr, v_words_ptr, blk_next, n0 + BLOCK_N, end,
                                        k_lane, v_lane, tv, stride_kc_b, stride_kc_s,
                                        stride_vc_b, stride_vc_s, BLOCK_SIZE)
            blk_next = _block_of(bt_row, n0 + 2 * BLOCK_N, end, BLOCK_SIZE)
        else:
            k_cur, v_cur = _load_tile(k_words_ptr, v_words_ptr, blk_next, n0, end, k_lane,
                                      v_lane, tv, stride_kc_b, stride_kc_s, stride_vc_b,
                                      stride_vc_s, BLOCK_SIZE)
            blk_next = _block_of(bt_row, n0 + BLOCK_N, end, BLOCK_SIZE)
        k4 = gl.expand_dims(gl.convert_layout(k_cur, KW), 2).broadcast_to([BLOCK_N, WORDS, 4])
        k16 = gl.reshape(_k_words_to_f16(k4, KV_E5M2),
                         [BLOCK_N, HEAD_DIM // 64, 4, 4, 2, 2])  # (n, p, c, w, r, i)
        k16 = gl.reshape(gl.permute(k16, [0, 1, 3, 4, 2, 5]),
                         [BLOCK_N, HEAD_DIM])  # (n, 16s + 8r + 2c + i), s = 4p + w
        k_op = gl.convert_layout(gl.permute(k16, [1, 0]), B_OP)  # register renaming only
        s = mma_v2(q_op, k_op, gl.zeros([16, BLOCK_N], gl.float32, layout=MMA)) * scale_log2
        tok = n0 + offs_n
        valid = tok < end
        if HAS_WINDOW:
            valid = valid & (tok >= lo)
        s = gl.where(valid[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        # P^T: S's first 8 rows, transposed; the same registers
        p8, _ = gl.split(gl.permute(gl.reshape(p.to(gl.float16), [2, 8, BLOCK_N]), [1, 2, 0]))
        p_op = gl.convert_layout(gl.permute(p8, [1, 0]), B_OP)
        alpha8, _ = gl.split(gl.permute(gl.reshape(alpha, [2, 8]), [1, 0]))
        alpha8 = gl.convert_layout(alpha8, gl.SliceLayout(0, MMA))  # a few lane shuffles
        v4 = gl.expand_dims(gl.convert_layout(v_cur, VW), 2).broadcast_to([BLOCK_N, WORDS, 4])
        v16 = gl.reshape(_v_words_to_f16(v4, KV_E5M2),
                         [BLOCK_N, PIECES, 8, CHUNK // 2, 2])  # (n, piece, g, m', r)
        v16 = gl.reshape(gl.permute(v16, [0, 1, 3, 4, 2]),
                         [BLOCK_N, HEAD_DIM])  # (n, 16m + 8r + g), m = piece * CHUNK/2 + m'
        v_op = gl.convert_layout(gl.permute(v16, [1, 0]), A_OP)  # register renaming only
        acc = mma_v2(v_op, p_op, acc * alpha8[None, :])

    m8, _ = gl.split(gl.permute(gl.reshape(m_i, [2, 8]), [1, 0]))
    l8, _ = gl.split(gl.permute(gl.reshape(l_i, [2, 8]), [1, 0]))
    m8 = gl.convert_layout(m8, gl.SliceLayout(0, MMA))
    l8 = gl.convert_layout(l8, gl.SliceLayout(0, MMA))
    if DIRECT:
        gl.store(o_rows, (acc * (v_scale / l8)[None, :]).to(o_ptr.dtype.element_ty),
                 mask=(heads < GROUP)[None, :])
        return
    if HAS_WINDOW:  # a split wholly before the window: zero output and weight
        out = acc / gl.where(l8 > 0, l8, 1.0)[None, :]
        lse = gl.where(l8 > 0, m8 + gl.log2(l8), float("-inf"))
    else:
        out = acc / l8[None, :]
        lse = m8 + gl.log2(l8)
    mo = (mid_o_ptr + b64 * stride_mo_b + hq[None, :] * stride_mo_h + split * stride_mo_s
          + d_out[:, None])
    gl.store(mo, out, mask=(heads < GROUP)[None, :])
    gl.store(mid_lse_ptr + b64 * stride_ml_b + hq * stride_ml_h + split, lse, mask=heads < GROUP)
