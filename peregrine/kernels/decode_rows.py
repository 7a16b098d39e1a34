"""A decode step's layers in one persistent kernel at batch 1, for 4-bit Llama-style models on
sm_90+ (Gluon), with whole-K row tiles and readiness counted a group of 128 outputs.

The other persistent form (decode_layers.py) shares each projection's (tile, group) units
evenly over the programs, so a tile's pieces lie in several programs that add partials through
L2 under a ticket, and every phase waits for the whole phase before. Here a projection is cut
into tiles of 16 output channels taken whole, every group of their K, by one program (tile t
by program (t + the phase's first program) % P, `balance`): no partials, no tickets, and a
tile's owner does its finish itself. A program is four partitions (a projection with none of
its tiles in a program is skipped by all of them):

- a producer warp copies the program's tiles of every projection, in the order the layers use
  them, into a ring of shared-memory chunks by TMA, waiting only for a free chunk; a chunk is
  8 groups of 128 inputs of one tile (`pack`: 16 rows of words, a row of scales and zero
  points);
- a loader warp copies each projection's input row into a shared-memory buffer (once the
  consumer warps are done with the projection before's; `DecodeRows.nbuf` buffers), 8
  groups at a time, as soon as the groups of the phase before's outputs that those 8 stand for
  are complete (each group of 128 outputs has a counter that its tiles' owners add their
  outputs to, release; the loader polls them, acquire), and for a normed input (qkv, gate/up)
  makes RMSNorm's 1 / rms from the tiles' sums of h^2 once all of them are in; for o and
  down it also copies h at the program's tiles, so that their finishes load nothing;
- four consumer warps take the tiles: a chunk's 8 groups two a warp (the int4 tensor-core
  GEMV's steps, wna16_gemv_tc.py; a chunk's groups scaled into the tile's sums once the next
  chunk's MMAs are issued), the warps' sums added at the tile's end, then the finish:

  1. qkv (channels reordered so that a tile's rows 2g, 2g + 1 are a q or k channel e and its
     RoPE partner e + 64): scale by 1 / rms, round, rotate, store q, or K and V into the
     paged cache at the step's slot; a group is a head;
  2. attention (KV heads x SPLITS programs, ring_attention.py's tensor-core share) copies its
     first block of earlier K/V rows into shared memory, waits for its six heads' counts (four
     query heads, K, V), then takes q and the step's own row and runs S = Q K^T and O = P V
     as MMAs; the share that merges adds to the o phase's counters;
  3. o: h = h + o (bf16), xn = h * g (the post-attention norm's weight), the tile's sum of h^2;
  4. gate/up (rows 2g, 2g + 1 a gate channel and its up channel): scale, round,
     silu(gate) * up, 8 outputs a tile;
  5. down: as o, with the next layer's input norm weight (the final norm's after the last).

- a releasing warp adds each finished tile's outputs to their group's counter (release) once
  the consumer warps say its finish is stored: they go on to the next tile's chunks without
  waiting for the release's round trip to L2.

Every partition reads the phase table from a copy in shared memory made at the start (from
global memory each read would be a round trip to L2: the loader's acquire polls invalidate
L1), and a tile's finish constants (cos and sin, or the norm's weights) are loaded at its
start. So a phase starts on the rows its first chunks read while the phase before is still writing
its last ones, and no phase waits for a whole phase. Every counter and sum has its own place
a layer, zeroed by the prologue each call. The norms round as decode_layers.py's do (the input
each projection reads is h * g rounded once; 1 / rms scales the sums). The packed words hold
their nibbles in the order (NIB) that makes each pair the decode takes out of a word two
adjacent inputs, so x's words are the MMAs' B registers as they were copied. In the `pre` form
the phases also write their outputs' sums a row of 8, from which the loader makes each chunk's
group sums, so that the consumers' steps are their weight MMAs alone (faster steps, a longer
chain between phases: which wins depends on the GPU, `DecodeRows.choose_placement`).
`DecodeRows` packs a model's layers and runs the prologue and the kernel;
`benchmarks/decode_rows_bench.py` checks and times it.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from peregrine.kernels._gluon import (cp_async, cta_barrier, fence_acq_rel_gpu_if, poll_acquire,
                                      poll_acquire4, ring_barriers, smem_reinterpret, tma_load,
                                      trap)
from peregrine.kernels.decode_layers import (ATTN, DOWN, GU, O, QKV, Dims, LayerWeights,
                                             check_resident, keep_fastest, offsets)
from peregrine.kernels.ring_attention import _mma_early, _mma_share
from peregrine.kernels.ring_gemv import _shfl
from peregrine.kernels.wna16_gemv_tc import _group_done, _step, _tiles

TILE = 16  # output channels a tile
CG = 8  # groups of 128 inputs a chunk
ROW = 128  # int32 words a row of the packed weights (a chunk: 16 rows of words, 1 of scales)
TAB = 16  # int64 fields a phase (see DecodeRows)
# the nibble of a packed word that holds input j of its 8: the decode takes nibbles p and p + 4
# (bits 4p and 16 + 4p) as one pair, which is then inputs 2p and 2p + 1, as x's words pair them
NIB = (0, 4, 1, 5, 2, 6, 3, 7)
TAB_C = gl.constexpr(TAB)
K_QKV, K_ATTN, K_O = gl.constexpr(QKV), gl.constexpr(ATTN), gl.constexpr(O)
K_GU, K_DOWN = gl.constexpr(GU), gl.constexpr(DOWN)
_TILE = gl.constexpr(TILE)
_ROW = gl.constexpr(ROW)
DONE = 128  # a group's count once its 128 outputs are written
DONE_C = gl.constexpr(DONE)
NDONE = gl.constexpr(4)  # tiles the consumers may finish ahead of their counts
# spare counters after the last phase's: a poll (_ready_groups) reads 128 from a multiple of 4
# at or past the phase before's first, the whole-phase wait 256
CNT_PAD = 256
# (programs an SM, ring stages, group sums made once) that choose_placement times: the first is
# the built form
PLACEMENTS = ((2, 4, False), (2, 4, True), (1, 8, False))
# the loader's wait: 1 a chunk's groups (the engine's), 0 the whole phase before, 2 none (a
# floor for measurement: the outputs are not the layers'), 3 none and no MMAs (the weight
# stream and the finishes alone, for measurement); with no weight stream (every ring slot
# given back unfilled, for measurement): 4 none (the consumer warps alone), 5 none and no
# MMAs (the consumer warps' work outside the chunks' steps)
WAITS = {"dataflow": 1, "phase": 0, "free": 2, "nochunk": 3, "nostream": 4, "skeleton": 5}


def pack(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """(K/8, N) words, (groups, N) bf16 scales and zero points -> (tiles * chunks * 17, ROW)
    int32: tile i's chunk c (groups 8c .. 8c + 7, tile-major) is 17 rows; its first 16 hold, for
    group gi of the chunk and step s (word rows 4s .. 4s + 3 of the group), 64 words at
    256 gi + 64 s: lane 4g + t's two at 2 (4g + t) + h are word row 4s + t of channels 2g + h of
    the tile (rows g and g + 8 of the MMA's M-tile), input j of the word row in nibble NIB[j];
    the 17th holds group gi's scale pairs (channels 2g, 2g + 1) at 16 gi + g and zero point
    pairs at 16 gi + 8 + g."""
    k8, n = qweight.shape
    groups = k8 // 16
    q64 = qweight.to(torch.int64) & 0xFFFFFFFF
    q64 = sum(((q64 >> (4 * j)) & 0xF) << (4 * NIB[j]) for j in range(8))
    qweight = torch.where(q64 >= 1 << 31, q64 - (1 << 32), q64).to(torch.int32)
    chunks, tiles = groups // CG, n // TILE
    w = qweight.view(chunks, CG, 4, 4, tiles, 8, 2)  # (c, gi, s, t, tile, g, h)
    w = w.permute(4, 0, 1, 2, 5, 3, 6).reshape(tiles, chunks, CG * 256)
    s32 = scales.contiguous().view(torch.int32).view(chunks, CG, tiles, 8)
    z32 = zeros.contiguous().view(torch.int32).view(chunks, CG, tiles, 8)
    sz = torch.cat([s32, z32], 3).permute(2, 0, 1, 3).reshape(tiles, chunks, CG * 16)
    return torch.cat([w, sz], 2).reshape(-1, ROW).contiguous()


def emulate(packed: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    """The product the kernel computes, from the packed rows as its lanes read them (float32,
    torch): a check of `pack`'s order that runs on the CPU."""
    k = x.numel()
    chunks, tiles = k // (128 * CG), n // TILE
    rows = packed.view(tiles, chunks, 17, ROW)
    words = rows[:, :, :16].reshape(tiles, chunks, CG, 4, 8, 4, 2)  # (.., gi, s, g, t, h)
    q = torch.stack([(words >> (4 * NIB[j])) & 0xF for j in range(8)], -1).float()
    # (tile, c, gi, s, g, t, h, j) -> weight of input 128 (8c + gi) + 32 s + 8 t + j, channel
    # 2g + h of the tile
    q = q.permute(0, 4, 6, 1, 2, 3, 5, 7).reshape(tiles, 8, 2, k)
    sz = rows[:, :, 16].reshape(tiles, chunks, CG, 2, 8)  # (.., gi, scale / zero, g)
    sz = sz.contiguous().view(torch.bfloat16).view(tiles, chunks, CG, 2, 8, 2).float()
    sz = sz.permute(0, 4, 5, 3, 1, 2).reshape(tiles, 8, 2, 2, k // 128)
    s = sz[:, :, :, 0].repeat_interleave(128, -1)
    z = sz[:, :, :, 1].repeat_interleave(128, -1)
    return ((q - z) * s * x.float()).sum(-1).reshape(n)


def qkv_order(heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The qkv weight's channel order in the kernel, tile by tile in the order the programs
    take them (`qkv_tile`: a KV head's query heads, K and V, then the next KV head's): in a q
    or k head, tile a's rows 2g and 2g + 1 are channels 8a + g and its RoPE partner
    8a + g + head_dim / 2; v heads as they are."""
    half = head_dim // 2
    a = torch.arange(half // 8).view(-1, 1, 1)
    g = torch.arange(8).view(1, -1, 1)
    h = torch.arange(2).view(1, 1, -1)
    head = (8 * a + g + half * h).reshape(-1)  # (tile a, g, h)
    roped = [hd * head_dim + head for hd in range(heads + kv_heads)]
    v0 = (heads + kv_heads) * head_dim
    tiles = torch.cat(roped + [torch.arange(v0, v0 + kv_heads * head_dim)]).view(-1, TILE)
    t = torch.arange(tiles.shape[0])
    return tiles[qkv_tile(t, heads, kv_heads, head_dim // TILE)].reshape(-1)


def qkv_tile(t, heads: int, kv_heads: int, per_head: int):
    """The qkv tile (q heads' tiles, then k's, then v's) that the programs take t-th: KV head
    kh's query heads, its K and its V, then KV head kh + 1's, so that the attention of the
    first KV heads can start while the last ones' tiles are still being made (_qkv_tile in
    the kernel)."""
    gqa = heads // kv_heads
    per = (gqa + 2) * per_head
    kh = t // per
    r = t % per
    q = kh * gqa * per_head + r
    k = heads * per_head + kh * per_head + (r - gqa * per_head)
    v = (heads + kv_heads) * per_head + kh * per_head + (r - (gqa + 1) * per_head)
    return torch.where(r < gqa * per_head, q, torch.where(r < (gqa + 1) * per_head, k, v))


def gate_up_rows(inter: int) -> torch.Tensor:
    """The gate/up weight's channel order in the kernel: tile t's rows 2g and 2g + 1 are gate
    channel 8t + g and the same up channel inter + 8t + g."""
    gate = torch.arange(inter)
    return torch.stack([gate, gate + inter], 1).reshape(-1)


@gluon.jit
def _qkv_tile(t, HEADS: gl.constexpr, KVH: gl.constexpr, PER_HEAD: gl.constexpr):
    """qkv_tile in the kernel."""
    GQA: gl.constexpr = HEADS // KVH
    PER: gl.constexpr = (GQA + 2) * PER_HEAD
    kh = t // PER
    r = t % PER
    q = kh * GQA * PER_HEAD + r
    k = HEADS * PER_HEAD + kh * PER_HEAD + (r - GQA * PER_HEAD)
    v = (HEADS + KVH) * PER_HEAD + kh * PER_HEAD + (r - (GQA + 1) * PER_HEAD)
    return gl.where(r < GQA * PER_HEAD, q, gl.where(r < (GQA + 1) * PER_HEAD, k, v))


@gluon.jit
def _tab(tab_s, f, j: gl.constexpr):
    """Field j of phase f from the table's copy in shared memory (every thread reads it)."""
    L1: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    return gl.sum(tab_s.index(f).slice(j, 1).load(L1), 0)


@gluon.jit
def _fill_table(tab_ptr, n_phases, tab_s, kvo_s, NPH: gl.constexpr):
    """The phase table (n_phases rows of TAB int64 fields) into shared memory: every field as
    int32 in tab_s, the cache offsets (fields 11 and 12, multiples of 8) over 8 as int64 in
    kvo_s; rows from n_phases to NPH zeros."""
    LF: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [gl.num_warps(), 1], [1, 0])
    LK: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [gl.num_warps(), 1], [1, 0])
    for p in gl.static_range(0, NPH, 32):
        r = p + gl.arange(0, 32, layout=gl.SliceLayout(1, LF))
        c = gl.arange(0, TAB_C, layout=gl.SliceLayout(0, LF))
        v = gl.load(tab_ptr + gl.expand_dims(r, 1) * TAB_C + gl.expand_dims(c, 0),
                    mask=gl.expand_dims(r < n_phases, 1) & gl.expand_dims(c >= 0, 0), other=0)
        tab_s.slice(p, 32).store(v.to(gl.int32))
        rk = p + gl.arange(0, 32, layout=gl.SliceLayout(1, LK))
        ck = gl.arange(0, 2, layout=gl.SliceLayout(0, LK))
        vk = gl.load(tab_ptr + gl.expand_dims(rk, 1) * TAB_C + 11 + gl.expand_dims(ck, 0),
                     mask=gl.expand_dims(rk < n_phases, 1) & gl.expand_dims(ck >= 0, 0), other=0)
        kvo_s.slice(p, 32).store(vk // 8)


@gluon.jit
def _first(tab_s, f, pid, P):
    """The program's first tile of phase f (tile t runs in program (t + first program) % P)."""
    return (pid + P - _tab(tab_s, f, 14)) % P


@gluon.jit
def _producer(desc_w, desc_s, wbufs, sbufs, ready, empty, tab_s, n_phases, P,
              S: gl.constexpr, MODE: gl.constexpr):
    """The program's tiles of every projection, chunk by chunk, into the next free slot (an
    attention phase has no tiles; MODE 4 and 5 give the slots back unfilled)."""
    pid = gl.program_id(0)
    i = 0
    for f in range(n_phases):
        base = _tab(tab_s, f, 1)
        tiles = _tab(tab_s, f, 2)
        C = _tab(tab_s, f, 3)
        for tile in range(_first(tab_s, f, pid, P), tiles, P):
            for c in range(C):
                slot = i % S
                mbarrier.wait(empty.index(slot), ((i // S) & 1) ^ 1)
                if MODE >= 4:
                    mbarrier.arrive(ready.index(slot), count=1)
                else:
                    mbarrier.expect(ready.index(slot), 17 * _ROW * 4)
                    row = (base + tile * C + c) * 17
                    tma_load(desc_w, [row, 0], ready.index(slot), wbufs.index(slot))
                    tma_load(desc_s, [row + 16, 0], ready.index(slot), sbufs.index(slot))
                i += 1


@gluon.jit
def _ready_groups(cnt_ptr, lo, gp, LG: gl.constexpr):
    """How many of the phase before's groups of outputs, from 0, are known complete: the
    counters [lo, lo + 128) read, those before lo complete already. A lane's four counters are
    one 16-byte acquire load, from lo rounded down to a multiple of 4 (a phase's counters start
    at a multiple of 4, and the last phase's are followed by CNT_PAD more), so that a poll is one
    round trip to L2. (Four acquire loads a lane would be four round trips one after another:
    each compiles to a load and an invalidation of L1 that waits for it.)"""
    lo = lo - lo % 4
    j = lo + gl.arange(0, 128, layout=LG)
    v = poll_acquire4(cnt_ptr + j)
    return gl.minimum(gl.min(gl.where((v >= DONE_C) | (j >= gp), lo + 128, j), 0), gp)


@gluon.jit
def _group_sums(xsums, row, rs_ptr, n, LP: gl.constexpr):
    """Up to four chunks' (n of them) 8 groups' input sums each from their rows' sums (16 rows
    of 8 a group, at rs_ptr) into xsums[row ..]: group gi's at gi of its chunk's row. The four
    loads are in flight together (one round trip)."""
    gi = gl.arange(0, 8, layout=gl.SliceLayout(1, LP))
    r = gl.arange(0, 16, layout=gl.SliceLayout(0, LP))
    off = gl.expand_dims(gi, 1) * 16 + gl.expand_dims(r, 0)
    v0 = gl.load(rs_ptr + off, cache_modifier=".cg")
    v1 = gl.load(rs_ptr + 128 + off, mask=(off >= 0) & (n > 1), other=0.0, cache_modifier=".cg")
    v2 = gl.load(rs_ptr + 256 + off, mask=(off >= 0) & (n > 2), other=0.0, cache_modifier=".cg")
    v3 = gl.load(rs_ptr + 384 + off, mask=(off >= 0) & (n > 3), other=0.0, cache_modifier=".cg")
    xsums.index(row).slice(0, 8).store(gl.sum(v0, 1))
    if n > 1:
        xsums.index(row + 1).slice(0, 8).store(gl.sum(v1, 1))
    if n > 2:
        xsums.index(row + 2).slice(0, 8).store(gl.sum(v2, 1))
    if n > 3:
        xsums.index(row + 3).slice(0, 8).store(gl.sum(v3, 1))


@gluon.jit
def _loader(xbufs, xsums, rrbuf, hbuf, xready, xfree, tab_s, n_phases, vec_ptr, cnt_ptr, ss_ptr,
            rs_ptr, eps, P, H: gl.constexpr, CMAX: gl.constexpr, MODE: gl.constexpr,
            PRE: gl.constexpr):
    """Each projection's input row into buffer gf % NBUF (gf: the projections so far that have
    tiles in this program; the consumer counts the same), once the consumer warps have freed
    it, a chunk's 8 groups at a time, as soon as the groups of the phase before's outputs they
    stand for are complete (MODE 1; 0: once all of them are; 2, 3: no wait):
    xready[gf % NBUF][c] says chunk c's groups have landed. A pass polls up to 128 counters in
    one round trip (_ready_groups), then copies every chunk they make ready in one more.
    A normed input's 1 / rms goes into rrbuf[gf % NBUF] before its last chunk is announced (every
    tile's sum of h^2 is in once every group is). PRE: each chunk's groups' input sums are
    made from their rows' sums (_group_sums). An o or down projection's pass that copies its
    first chunks also copies the residual stream h of the program's tiles into
    hbuf[b * HT + j] (the tiles' finishes add to it): the counters it acquired follow every
    write of h before (each tile of the phase before waited for 1 / rms, so for all of the
    phase before it)."""
    LP: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0])
    LC: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [1, 1], [1, 0])
    LG: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
    NSS: gl.constexpr = H // 16
    LS: gl.constexpr = gl.BlockedLayout([NSS // 32], [32], [1], [0])
    L32: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    r = gl.arange(0, 32, layout=gl.SliceLayout(1, LC))
    w = gl.arange(0, 4, layout=gl.SliceLayout(0, LC))
    off = gl.expand_dims(r, 1) * 4 + gl.expand_dims(w, 0)
    src0 = vec_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    NB: gl.constexpr = xbufs.shape[1] // 32  # blocks of 32 rows a buffer
    NBUF: gl.constexpr = xbufs.shape[0]
    blocks = smem_reinterpret(xbufs, gl.int32, [NBUF * NB, 32, 4],
                              gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    HT: gl.constexpr = hbuf.shape[0] // xbufs.shape[0]  # a phase's tiles a program, at most
    LH: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
    pid = gl.program_id(0)
    gf = 0
    for f in range(n_phases):
        # (a projection with none of its tiles here: nothing to copy, no buffer used)
        if (_tab(tab_s, f, 0) != K_ATTN) & (_first(tab_s, f, pid, P) < _tab(tab_s, f, 2)):
            C = _tab(tab_s, f, 3)
            x_off = _tab(tab_s, f, 4)
            rs_in = _tab(tab_s, f, 15)
            gp = _tab(tab_s, f, 6)
            pcnt = _tab(tab_s, f, 7)
            ss_in = _tab(tab_s, f, 8)
            b = gf % NBUF
            mbarrier.wait(xfree.index(b), ((gf // NBUF) & 1) ^ 1)
            G = C * 8
            done = 0
            passes = 0
            while done < C:
                if (MODE >= 2) or (gp == 0):
                    upto = C
                elif MODE == 0:  # (up to 256 groups of outputs)
                    avail = _ready_groups(cnt_ptr + pcnt, 0, gp, LG)
                    avail = gl.where(avail >= 128, _ready_groups(cnt_ptr + pcnt, 128, gp, LG),
                                     avail)
                    upto = gl.where(avail >= gp, C, 0)
                else:
                    avail = _ready_groups(cnt_ptr + pcnt, (8 * done * gp) // G, gp, LG)
                    upto = gl.minimum(C, (avail * G) // (8 * gp))
                # each lane acquired only its own counters: a barrier of the warp orders every
                # lane's reads below (the copies, the sums) after all of those acquires
                cta_barrier()
                for c in range(done, upto):  # the chunk's 8 groups: 128 rows of 16 B
                    src = src0 + gl.multiple_of(x_off // 2 + c * 512, 64) + off
                    for q in gl.static_range(4):
                        cp_async(blocks.index(b * NB + 4 * c + q), src + q * 128,
                                 cache_modifier=".cg")
                kind = _tab(tab_s, f, 0)
                if ((kind == K_O) | (kind == K_DOWN)) & (done == 0) & (upto > 0):
                    first = _first(tab_s, f, pid, P)
                    tiles = _tab(tab_s, f, 2)
                    for j in gl.static_range(HT):  # (a tile's 16 channels: 8 words)
                        hw = src0 + (first + j * P) * 8 + gl.arange(0, 8, layout=LH)
                        cp_async(hbuf.index(b * HT + j), hw,
                                 mask=(gl.arange(0, 8, layout=LH) >= 0) & (first + j * P < tiles),
                                 cache_modifier=".cg")
                async_copy.commit_group()
                # every tile's sum of h^2 is in once every group is: read in flight with the
                # copies (not after them: the last chunk's announcement waits for 1 / rms)
                normed = (upto == C) & (ss_in >= 0)
                sq = gl.load(ss_ptr + ss_in + gl.arange(0, NSS, layout=LS),
                             mask=(gl.arange(0, NSS, layout=LS) >= 0) & normed, other=0.0,
                             cache_modifier=".cg")
                if PRE:
                    for c in range(done, upto, 4):
                        _group_sums(xsums, b * CMAX + c, rs_ptr + rs_in + 128 * c, upto - c,
                                    LP)
                async_copy.wait_group(0)
                if normed:
                    rr = gl.rsqrt(gl.sum(sq, 0) / H + eps)
                    rrbuf.index(b).store(gl.full([32], 0.0, gl.float32, layout=L32) + rr)
                cta_barrier()  # (every lane's copies and stores before the arrivals)
                for c in range(done, upto):
                    mbarrier.arrive(xready.index(b * CMAX + c), count=1)
                done = gl.maximum(done, upto)
                passes += 1
                if passes > (1 << 24):  # a phase that never completes: fail, do not hang
                    trap()
            for c in range(C, CMAX):  # (every barrier of the buffer completes once a use)
                mbarrier.arrive(xready.index(b * CMAX + c), count=1)
            gf += 1


@gluon.jit
def _rows(w, L: gl.constexpr, T: gl.constexpr, WARPS: gl.constexpr):
    """A word of rows 0..3 of each warp's group ([WARPS, 4]) as the [T] tensor whose lane 4g + t
    holds row t's."""
    B3: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0])
    w = gl.convert_layout(w, gl.SliceLayout(1, B3))
    return gl.convert_layout(
        gl.reshape(gl.expand_dims(w, 1).broadcast_to([WARPS, 8, 4]), [T]), L)


@gluon.jit
def _add4(a, b):
    """Two sets of four registers added."""
    return a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]


@gluon.jit
def _chunk(wv, xc, ones, sel, L: gl.constexpr, T: gl.constexpr, WARPS: gl.constexpr,
           PRE: gl.constexpr = False):
    """One ring chunk's MMAs: warp w's groups 2w and 2w + 1 of the chunk, each four MMA steps
    on the words (wv) and x's rows (xc) into two accumulator sets (even and odd steps:
    dependent chains half as long, added here), and (not PRE) the input sums' MMAs; x's words
    are the steps' B registers as they are (the words' nibble order, NIB). Returns the two
    groups' (C registers, input sums) for _chunk_done."""
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2], [1, 1, 1, 32], [WARPS, 1, 1, 1],
                                        [3, 2, 1, 0])
    LX: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 1, 4, 8], [WARPS, 1, 1, 1],
                                        [2, 3, 1, 0])
    zero = gl.zeros([T], gl.float32, layout=L)
    c4 = (zero, zero, zero, zero)
    out = ()
    for h in gl.static_range(2):
        acc = (c4, c4, c4, c4)  # (the even steps'; acc_b, cx_b the odd steps')
        cx = c4
        acc_b = (c4, c4, c4, c4)
        cx_b = c4
        for s in gl.static_range(4):
            wl = wv.slice(h, 1, dim=1).slice(s, 1, dim=2).load(LW)
            e0, e1 = gl.split(gl.reshape(wl, [WARPS, 32, 2]))
            e0 = gl.convert_layout(gl.reshape(e0, [T]), L)
            e1 = gl.convert_layout(gl.reshape(e1, [T]), L)
            xl = xc.slice(h, 1, dim=1).slice(4 * s, 4, dim=2).load(LX)
            pa, pb = gl.split(gl.reshape(xl, [WARPS, 4, 2, 2]))
            x0, x2 = gl.split(pa)
            x1, x3 = gl.split(pb)
            bx = (_rows(x0, L, T, WARPS), _rows(x1, L, T, WARPS), _rows(x2, L, T, WARPS),
                  _rows(x3, L, T, WARPS))
            w8 = (e0, e0, e0, e0, e1, e0, e0, e0)
            if PRE:
                if s % 2 == 0:
                    acc = (_tiles(w8, 0, bx, acc[0], sel, 4, True), c4, c4, c4)
                else:
                    acc_b = (_tiles(w8, 0, bx, acc_b[0], sel, 4, True), c4, c4, c4)
            else:
                if s % 2 == 0:
                    acc, cx = _step(acc, cx, ones, w8, bx, sel, 1, True, 4)
                else:
                    acc_b, cx_b = _step(acc_b, cx_b, ones, w8, bx, sel, 1, True, 4)
        out = out + ((_add4(acc[0], acc_b[0]), _add4(cx, cx_b)),)
    return out


@gluon.jit
def _chunk_done(y, groups, sv, g, L: gl.constexpr, T: gl.constexpr, WARPS: gl.constexpr,
                PRE: gl.constexpr = False, xs=None, w_id=None):
    """The tile's sums y plus a chunk's two groups (_chunk's), scaled by their scales and zero
    points (sv, the chunk's row of them, in registers). PRE: xs holds the groups' input sums
    (group gi's at gi; w_id: the warp)."""
    B2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [WARPS, 1], [1, 0])
    zero = gl.zeros([T], gl.float32, layout=L)
    c4 = (zero, zero, zero, zero)
    if PRE:
        xs4 = xs.load(gl.SliceLayout(0, B2))
        xs4 = gl.convert_layout(gl.reshape(gl.expand_dims(xs4, 0).broadcast_to([WARPS, 32]),
                                           [T]), L).to(gl.int32, bitcast=True)
    for h in gl.static_range(2):
        s_w = _shfl(sv, 16 * h + g)
        z_w = _shfl(sv, 16 * h + 8 + g)
        acc, cx = groups[h]
        if PRE:
            xg = _shfl(xs4, 2 * w_id + h).to(gl.float32, bitcast=True)
            cx = (xg, xg, xg, xg)
        y = _group_done(y, (acc, c4, c4, c4), cx, ((s_w, s_w, s_w, s_w), (z_w, z_w, z_w, z_w)),
                        0, 1, True, True, 4)
    return y


@gluon.jit
def _finish_inputs(kind, tile, ch, g_ptr, cs_ptr, pos, HEADS: gl.constexpr, KVH: gl.constexpr,
                   D: gl.constexpr):
    """The constants tile `tile`'s finish reads, loaded at the tile's start so that their round
    trip passes in the shadow of its chunks: cos and sin of a q or k tile's channels, or the
    norm weights of an o or down tile's (float32; zeros for the others)."""
    HALF: gl.constexpr = D // 2
    rope = (kind == K_QKV) & (tile // (D // 16) < HEADS + KVH) & (ch >= 0)
    e = 8 * (tile % (D // 16)) + ch
    cos = gl.load(cs_ptr + pos * D + e, mask=rope, other=0.0)
    sin = gl.load(cs_ptr + pos * D + HALF + e, mask=rope, other=0.0)
    resid = (kind != K_QKV) & (kind != K_GU) & (ch >= 0)
    n = 16 * tile + 2 * ch
    g0 = gl.load(g_ptr + n, mask=resid, other=0.0).to(gl.float32)
    g1 = gl.load(g_ptr + n + 1, mask=resid, other=0.0).to(gl.float32)
    return gl.where(rope, cos, g0), gl.where(rope, sin, g1)


@gluon.jit
def _finish(kind, tile, v0, v1, rr, ch, c0, c1, hw, vec_ptr, ss_out_ptr, slot, kc_ptr, vc_ptr,
            rs_ptr, H: gl.constexpr, HEADS: gl.constexpr, KVH: gl.constexpr,
            D: gl.constexpr, PRE: gl.constexpr):
    """Tile `tile`'s finish from its rows' sums v0 (rows 2g) and v1 (rows 2g + 1), g = ch
    (see the module docstring), its constants c0, c1 (_finish_inputs) and, for o or down,
    h's channels 2g, 2g + 1 as a word (the loader's copy). PRE: the sums a row of 8 of the
    outputs that a projection reads (rs_ptr)."""
    HALF: gl.constexpr = D // 2
    Q_OFF: gl.constexpr = 2 * H
    ACT_OFF: gl.constexpr = Q_OFF + 2 * HEADS * D
    if kind == K_QKV:
        y0 = (v0 * rr).to(gl.bfloat16).to(gl.float32)
        y1 = (v1 * rr).to(gl.bfloat16).to(gl.float32)
        head = tile // (D // 16)
        a = tile % (D // 16)
        if head < HEADS + KVH:  # q or k: rows 2g, 2g + 1 are channels e and e + D / 2
            e = 8 * a + ch
            r0 = (y0 * c0 - y1 * c1).to(gl.bfloat16)  # (c0, c1: cos, sin)
            r1 = (y1 * c0 + y0 * c1).to(gl.bfloat16)
            if head < HEADS:
                gl.store(vec_ptr + Q_OFF + head * D + e, r0)
                gl.store(vec_ptr + Q_OFF + head * D + HALF + e, r1)
            elif slot >= 0:  # (slot -1: a padding row stores no K/V)
                kb = kc_ptr + (slot * KVH + (head - HEADS)) * D
                gl.store(kb + e, r0)
                gl.store(kb + HALF + e, r1)
        elif slot >= 0:
            vb = vc_ptr + (slot * KVH + (head - HEADS - KVH)) * D + 16 * a + 2 * ch
            gl.store(vb, y0.to(gl.bfloat16))
            gl.store(vb + 1, y1.to(gl.bfloat16))
    elif kind == K_GU:  # rows 2g: gate channel 8 tile + g, rows 2g + 1: its up channel
        gt = (v0 * rr).to(gl.bfloat16).to(gl.float32)
        up = (v1 * rr).to(gl.bfloat16).to(gl.float32)
        act = (gt / (1.0 + gl.exp(-gt)) * up).to(gl.bfloat16)
        gl.store(vec_ptr + ACT_OFF + 8 * tile + ch, act)
        if PRE:
            gl.store(rs_ptr + (H + HEADS * D) // 8 + tile, gl.sum(act.to(gl.float32), 0))
    else:  # o or down: the residual add, the next norm's input and the tile's sum of h^2
        n = 16 * tile + 2 * ch
        h0 = (hw << 16).to(gl.float32, bitcast=True)  # (bf16 to float32: exact)
        h1 = (hw & -65536).to(gl.float32, bitcast=True)
        hb0 = (h0 + v0.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16)
        hb1 = (h1 + v1.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16)
        gl.store(vec_ptr + n, hb0)
        gl.store(vec_ptr + n + 1, hb1)
        f0 = hb0.to(gl.float32)
        f1 = hb1.to(gl.float32)
        x0 = (f0 * c0).to(gl.bfloat16)  # (c0, c1: the norm's weights)
        x1 = (f1 * c1).to(gl.bfloat16)
        gl.store(vec_ptr + H + n, x0)
        gl.store(vec_ptr + H + n + 1, x1)
        gl.store(ss_out_ptr + tile, gl.sum(f0 * f0 + f1 * f1, 0))
        if PRE:
            both = x0.to(gl.float32) + x1.to(gl.float32)
            gl.store(rs_ptr + 2 * tile, gl.sum(gl.where(ch < 4, both, 0.0), 0))
            gl.store(rs_ptr + 2 * tile + 1, gl.sum(gl.where(ch < 4, 0.0, both), 0))


@gluon.jit
def _wait_heads(cnt_ptr, kh, HEADS: gl.constexpr, KVH: gl.constexpr, WARPS: gl.constexpr,
                LIMIT: gl.constexpr = 1 << 26):
    """Spin until the qkv phase's groups for KV head kh (its four query heads, K, V) are
    written (acquire), then a barrier of the consumer warps passes that on."""
    L8: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    j = gl.arange(0, 8, layout=L8)
    grp = gl.where(j < 4, 4 * kh + j, gl.where(j == 4, HEADS + kh, HEADS + KVH + kh))
    seen = gl.min(poll_acquire(cnt_ptr + grp), 0)
    n = 0
    while seen < DONE_C:
        seen = gl.min(poll_acquire(cnt_ptr + grp), 0)
        n += 1
        if n > LIMIT:
            trap()
    cta_barrier()


@gluon.jit
def _releaser(done, dfree, tab_s, n_phases, cnt_ptr, P, HEADS: gl.constexpr,
              KVH: gl.constexpr, D: gl.constexpr):
    """The program's tiles' outputs counted (release, GPU scope) in the order the consumer
    warps finish them, each once they say its finish is stored, so that they go on to the next
    tile without waiting for the release's round trip."""
    pid = gl.program_id(0)
    k = 0
    for f in range(n_phases):
        kind = _tab(tab_s, f, 0)
        if kind != K_ATTN:
            cnt_off = _tab(tab_s, f, 5)
            outs = _tab(tab_s, f, 13)
            for tile in range(_first(tab_s, f, pid, P), _tab(tab_s, f, 2), P):
                mbarrier.wait(done.index(k % NDONE), (k // NDONE) & 1)
                if kind == K_QKV:
                    real = _qkv_tile(tile, HEADS, KVH, D // 16)
                else:
                    real = tile
                gl.atomic_add(cnt_ptr + cnt_off + (real * outs) // DONE_C, outs, sem="release",
                              scope="gpu")
                mbarrier.arrive(dfree.index(k % NDONE), count=1)
                k += 1


@gluon.jit
def _consumer(wbufs, sbufs, xbufs, xsums, rrbuf, hbuf, tsum0, tsum1, q_s, k_s, v_s, ready,
              empty, xready, xfree, done, dfree, tab_s, kvo_s, n_phases, vec_ptr, norm_ptr,
              ss_ptr, rs_ptr, apart_ptr, lock_ptr, cnt_ptr, cs_ptr, pos_ptr, slot_ptr, bt_ptr,
              kc_ptr, vc_ptr, scale, P, S: gl.constexpr, CMAX: gl.constexpr,
              GMAX: gl.constexpr, H: gl.constexpr, HEADS: gl.constexpr, KVH: gl.constexpr,
              D: gl.constexpr, BS: gl.constexpr, SPLITS: gl.constexpr, TB: gl.constexpr,
              MODE: gl.constexpr, PRE: gl.constexpr):
    """The program's tiles of every projection (the loader's buffer waited for chunk by chunk
    on the phase's first tile), the warps' sums added at a tile's end, its finish, and its
    outputs counted (release); and, in the first KVH * SPLITS programs, attention."""
    WARPS: gl.constexpr = 4
    T: gl.constexpr = 32 * WARPS
    L: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    LT: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    L32: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    STEPS: gl.constexpr = (MODE != 3) and (MODE != 5)  # (3, 5: no chunk MMAs, for measurement)
    # a tile's sums as (warp, row pair, lane of the quad), and the warps' sums a lane
    Q3: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0])
    LW4: gl.constexpr = gl.BlockedLayout([WARPS, 1], [1, 32], [1, WARPS], [1, 0])
    pid = gl.program_id(0)
    idx = gl.arange(0, T, layout=L)
    lane = idx % 32
    g = lane // 4
    t = lane % 4
    sel = gl.where(t % 2 == 0, 0x4140, 0x4342)  # (6-bit weights only; _step's argument)
    zero = gl.zeros([T], gl.float32, layout=L)
    ones = gl.full([T], 0x3F803F80, gl.int32, layout=L)  # bf16 1.0 pairs
    ch = gl.arange(0, 8, layout=LT)  # a tile's row pairs
    pos = gl.load(pos_ptr).to(gl.int64)
    slot = gl.load(slot_ptr).to(gl.int64)
    # views of the whole buffers (a view of one slot cannot be reinterpreted)
    NBUF: gl.constexpr = xbufs.shape[0]
    HT: gl.constexpr = hbuf.shape[0] // NBUF
    xv = smem_reinterpret(xbufs, gl.int32, [NBUF * (GMAX // 8), WARPS, 2, 16, 4],
                          gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
    wvs = smem_reinterpret(wbufs, gl.int32, [S, WARPS, 2, 4, 64],
                           gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
    svs = smem_reinterpret(sbufs, gl.int32, [S, T], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    i = 0
    gf = 0
    k = 0  # tiles finished
    for f in range(n_phases):
        kind = _tab(tab_s, f, 0)
        cnt_off = _tab(tab_s, f, 5)
        # the layer's caches (16-byte aligned: bind_caches)
        kc_l = kc_ptr + _tab(kvo_s, f, 0) * 8
        vc_l = vc_ptr + _tab(kvo_s, f, 1) * 8
        if kind == K_ATTN:
            apid = _first(tab_s, f, pid, P)  # (the phase's programs: apid < KVH * SPLITS)
            if apid < KVH * SPLITS:
                kh = apid // SPLITS
                # the earlier steps' K/V rows need no wait
                _mma_early(apid, k_s, v_s, kc_l, vc_l, bt_ptr, pos, KVH, D, BS, SPLITS, TB, WARPS)
                if MODE < 2:
                    _wait_heads(cnt_ptr + _tab(tab_s, f, 7), kh, HEADS, KVH, WARPS)
                merged = _mma_share(apid, vec_ptr, kc_l, vc_l, bt_ptr, pos, slot, scale, q_s, k_s,
                                    v_s, apart_ptr, lock_ptr, H, HEADS, KVH, D, BS, SPLITS, TB,
                                    WARPS, ss_ptr, 0, rs_ptr + H // 8, PRE)
                if merged:  # the head's four query heads' outputs are in: count them
                    # one release fence, then plain adds: four release adds would each wait
                    # for the one before to reach L2 (a fence each), with the o phase's
                    # loader waiting for the last
                    cta_barrier()
                    fence_acq_rel_gpu_if(gl.full([T], 1, gl.int32, layout=L))
                    for j in gl.static_range(HEADS // KVH):
                        gl.atomic_add(cnt_ptr + cnt_off + (HEADS // KVH) * kh + j, DONE_C,
                                      sem="relaxed", scope="gpu")
        elif _first(tab_s, f, pid, P) < _tab(tab_s, f, 2):  # (else none of its tiles here)
            tiles = _tab(tab_s, f, 2)
            C = _tab(tab_s, f, 3)
            outs = _tab(tab_s, f, 13)  # outputs a tile
            ss_out = ss_ptr + _tab(tab_s, f, 9)
            g_l = norm_ptr + _tab(tab_s, f, 10)
            b = gf % NBUF
            rr = gl.max(gl.full([32], 1.0, gl.float32, layout=L32), 0)
            first = _first(tab_s, f, pid, P)
            for tile in range(first, tiles, P):
                if kind == K_QKV:  # (the tiles in the order qkv_order packs them)
                    real = _qkv_tile(tile, HEADS, KVH, D // 16)
                else:
                    real = tile
                c0, c1 = _finish_inputs(kind, real, ch, g_l, cs_ptr, pos, HEADS, KVH, D)
                y = (zero, zero, zero, zero, zero, zero, zero, zero)
                # a chunk's groups are added to y after the next chunk's MMAs are issued, so
                # that a warp does not wait for its MMA chains at every chunk (the chunk
                # before the first: zeros, which add nothing)
                c4 = (zero, zero, zero, zero)
                prev = ((c4, c4), (c4, c4))
                sv_prev = gl.zeros([T], gl.int32, layout=L)
                for c in range(C):
                    if tile == first:
                        mbarrier.wait(xready.index(b * CMAX + c), (gf // NBUF) & 1)
                    slot_r = i % S
                    mbarrier.wait(ready.index(slot_r), (i // S) & 1)
                    if STEPS:
                        sv = svs.index(slot_r).load(L)
                        groups = _chunk(wvs.index(slot_r), xv.index(b * (GMAX // 8) + c), ones,
                                        sel, L, T, WARPS, PRE)
                        y = _chunk_done(y, prev, sv_prev, g, L, T, WARPS, PRE,
                                        xsums.index(b * CMAX + gl.maximum(c - 1, 0)), idx // 32)
                        prev, sv_prev = groups, sv
                    else:  # (no MMAs: for measurement)
                        cta_barrier()
                    # every warp's reads of the slot are ordered before the TMA that refills
                    # it (a proxy fence: the refill is an async-proxy write), then a barrier
                    # of the consumer warps and one thread's arrive
                    fence_async_shared()
                    mbarrier.arrive(empty.index(slot_r), count=1)
                    i += 1
                if STEPS:
                    y = _chunk_done(y, prev, sv_prev, g, L, T, WARPS, PRE,
                                    xsums.index(b * CMAX + C - 1), idx // 32)
                if tile == first:
                    rr = gl.max(rrbuf.index(b).load(L32), 0)
                # the warps' sums of the tile's rows 2g (y[0]) and 2g + 1 (y[4]), equal in a
                # quad's four lanes, added over the warps: each warp's 8 of each into shared
                # memory, then every lane adds the four warps' in its registers (two barriers
                # a tile; a reduction over the warps' axis takes six)
                tsum0.store(gl.max(gl.convert_layout(gl.reshape(y[0], [WARPS, 8, 4]), Q3), 2))
                tsum1.store(gl.max(gl.convert_layout(gl.reshape(y[4], [WARPS, 8, 4]), Q3), 2))
                v0 = gl.convert_layout(gl.sum(tsum0.load(LW4), 0), LT)
                v1 = gl.convert_layout(gl.sum(tsum1.load(LW4), 0), LT)
                # (h only where o or down: the other phases' tiles can be more than HT)
                hw = hbuf.index(b * HT + gl.minimum((tile - first) // P, HT - 1)).load(LT)
                _finish(kind, real, v0, v1, rr, ch, c0, c1, hw, vec_ptr, ss_out, slot, kc_l,
                        vc_l, rs_ptr, H, HEADS, KVH, D, PRE)
                # the releasing warp counts the tile's outputs (the arrive is a barrier of
                # the consumer warps, after every warp's stores, and one thread's arrive)
                mbarrier.wait(dfree.index(k % NDONE), ((k // NDONE) & 1) ^ 1)
                mbarrier.arrive(done.index(k % NDONE), count=1)
                k += 1
            mbarrier.arrive(xfree.index(b), count=1)
            gf += 1


@gluon.jit
def decode_rows_kernel(desc_w, desc_s, tab_ptr, n_phases, vec_ptr, norm_ptr, ss_ptr, rs_ptr,
                       apart_ptr, lock_ptr, cnt_ptr, cs_ptr, pos_ptr, slot_ptr, bt_ptr, kc_ptr,
                       vc_ptr, eps, scale, P, S: gl.constexpr, GMAX: gl.constexpr,
                       CMAX: gl.constexpr, H: gl.constexpr, HEADS: gl.constexpr,
                       KVH: gl.constexpr, D: gl.constexpr, BS: gl.constexpr,
                       SPLITS: gl.constexpr, TB: gl.constexpr, MODE: gl.constexpr = 1,
                       PRE: gl.constexpr = 0, NBUF: gl.constexpr = 1,
                       NPH: gl.constexpr = 32, HT: gl.constexpr = 1):
    """The layers of the phase table (TAB int64 fields a phase), from the residual stream h
    and the first norm's input xn (in vec) and its tiles' sums of h^2 to the last layer's h
    (see the module docstring). MODE: the loader's wait (WAITS); PRE: the projections read
    their groups' input sums, made once from the sums a row of 8 (rs_ptr) that the phases
    before write. NPH: the phases rounded up to a power of 2, at least 32 (the table's copy in
    shared memory); HT: the most tiles of 16 channels of h a program takes in a phase, rounded
    up to a power of 2."""
    # the phase table in shared memory, which every partition reads at each phase (from global
    # memory each read would be a round trip to L2: the polls' acquires invalidate L1): its
    # fields as int32, and the layer's cache offsets as int64
    ROWS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    tab_s = gl.allocate_shared_memory(gl.int32, [NPH, TAB_C], ROWS)
    kvo_s = gl.allocate_shared_memory(gl.int64, [NPH, 2], ROWS)
    _fill_table(tab_ptr, n_phases, tab_s, kvo_s, NPH)
    # (seen as rows: a row's fields are read one at a time)
    ROW1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    tab_s = smem_reinterpret(tab_s, gl.int32, [NPH, TAB_C], ROW1)
    kvo_s = smem_reinterpret(kvo_s, gl.int64, [NPH, 2], ROW1)
    wbufs = gl.allocate_shared_memory(gl.int32, [S, 16, _ROW], desc_w.layout)
    sbufs = gl.allocate_shared_memory(gl.int32, [S, 1, _ROW], desc_s.layout)
    xbufs = gl.allocate_shared_memory(gl.int32, [NBUF, GMAX * 16, 4],
                                      gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    rrbuf = gl.allocate_shared_memory(gl.float32, [2, 32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # h of the program's o or down tiles (HT at most), a set a buffer
    hbuf = gl.allocate_shared_memory(gl.int32, [NBUF * HT, 8],
                                     gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # (two buffers, not one of two: the compiler's barriers treat a buffer as one)
    tsum0 = gl.allocate_shared_memory(gl.float32, [4, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    tsum1 = gl.allocate_shared_memory(gl.float32, [4, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    xsums = gl.allocate_shared_memory(gl.float32, [2 * CMAX, 32],
                                      gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # attention's query rows (16, the head's four first) and a block of K and V rows
    QKV_SMEM: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    q_s = gl.allocate_shared_memory(gl.bfloat16, [16, D], QKV_SMEM)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [TB, D], QKV_SMEM)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [TB, D], QKV_SMEM)
    ready, empty = ring_barriers(S)
    done, dfree = ring_barriers(NDONE)
    xready = gl.allocate_shared_memory(gl.int64, [2 * CMAX, 1], mbarrier.MBarrierLayout())
    xfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(2 * CMAX):
        mbarrier.init(xready.index(j), count=1)
    for j in gl.static_range(2):
        mbarrier.init(xfree.index(j), count=1)
    gl.warp_specialize([
        (_consumer, (wbufs, sbufs, xbufs, xsums, rrbuf, hbuf, tsum0, tsum1, q_s, k_s, v_s, ready,
                     empty, xready, xfree, done, dfree, tab_s, kvo_s, n_phases, vec_ptr, norm_ptr,
                     ss_ptr, rs_ptr, apart_ptr, lock_ptr, cnt_ptr, cs_ptr, pos_ptr, slot_ptr,
                     bt_ptr, kc_ptr, vc_ptr, scale, P, S, CMAX, GMAX, H, HEADS, KVH, D, BS, SPLITS,
                     TB, MODE, PRE)),
        (_producer, (desc_w, desc_s, wbufs, sbufs, ready, empty, tab_s, n_phases, P, S,
                      MODE)),
        (_loader, (xbufs, xsums, rrbuf, hbuf, xready, xfree, tab_s, n_phases, vec_ptr, cnt_ptr,
                   ss_ptr, rs_ptr, eps, P, H, CMAX, MODE, PRE)),
        (_releaser, (done, dfree, tab_s, n_phases, cnt_ptr, P, HEADS, KVH, D)),
    ], [1, 1, 1], [48, 80, 48])


@triton.jit
def rows_prologue_kernel(table_ptr, tok_ptr, g_ptr, vec_ptr, ss_ptr, rs_ptr, lock_ptr, cnt_ptr,
                         n_lock, n_cnt, H: tl.constexpr):
    """The persistent kernel's inputs, one program a block of 128 channels: h = row tok[0] of
    table (the embedding, or the step's row itself with tok 0), xn = h * g rounded to bf16
    (with its sums a row of 8) and the sums of h^2 a tile of 16; the counters zeroed (a share
    each) and, in program 0, the attention tickets."""
    j = tl.program_id(0)
    c = j * 128 + tl.arange(0, 128)
    row = tl.load(tok_ptr).to(tl.int64)
    h = tl.load(table_ptr + row * H + c)
    tl.store(vec_ptr + c, h)
    hf = h.to(tl.float32)
    g = tl.load(g_ptr + c).to(tl.float32)
    xn = (hf * g).to(tl.bfloat16)
    tl.store(vec_ptr + H + c, xn)
    tl.store(rs_ptr + j * 16 + tl.arange(0, 16),
             tl.sum(tl.reshape(xn.to(tl.float32), (16, 8)), 1))
    tl.store(ss_ptr + j * 8 + tl.arange(0, 8), tl.sum(tl.reshape(hf * hf, (8, 16)), 1))
    for k in range(j * 128, n_cnt, tl.num_programs(0) * 128):
        tl.store(cnt_ptr + k + tl.arange(0, 128), 0, mask=k + tl.arange(0, 128) < n_cnt)
    if j == 0:
        for k in range(0, n_lock, 128):
            tl.store(lock_ptr + k + tl.arange(0, 128), 0, mask=k + tl.arange(0, 128) < n_lock)


def balance(phases: list[tuple[int, int]], programs: int,
            attention_cost: int = 4) -> list[int]:
    """Each phase's first program (its tile t runs in program (t + first) % programs) for a
    layer's phases, (tiles, chunks a tile) each, (programs, -1) for attention: a phase's tiles
    past its whole rounds go to the window of programs with the least work so far in the
    layer, counted in chunks (an attention program's share as attention_cost chunks)."""
    load = [0] * programs
    firsts = []
    for tiles, chunks in phases:
        if chunks < 0:  # attention: its programs, a window of `tiles`
            extra, per, cost = tiles, 0, attention_cost
        else:
            extra, per, cost = tiles % programs, tiles // programs, chunks
        best = min(range(programs),
                   key=lambda o: sum(load[(o + j) % programs] for j in range(extra)))
        firsts.append(best)
        for p in range(programs):
            load[p] += per * cost
        for j in range(extra):
            load[(best + j) % programs] += cost
    return firsts


def unsupported(dims: Dims, layers: list[LayerWeights], dtype: torch.dtype,
                programs: int | None = None, splits: int = 16) -> str | None:
    """Why the kernel cannot run these layers (None: it can)."""
    from peregrine.kernels import decode_layers as kd
    reason = kd.unsupported(dims, layers, dtype, 4, programs, splits)
    if reason is not None:
        return reason
    for name, k in (("hidden size", dims.hidden), ("intermediate size", dims.inter),
                    ("attention width", dims.heads * dims.head_dim)):
        if k % (128 * CG):
            return f"{name} {k} is not a multiple of {128 * CG} (a chunk's inputs)"
    if dims.hidden % 512:
        return f"hidden size {dims.hidden} is not a multiple of 512 (the loader's sums)"
    return None


class DecodeRows:
    """A model's decoder layers packed for decode_rows_kernel, and the call that runs a one-row
    decode step through all of them. The packed weights are a second copy of the layers' 4-bit
    words with their scales and zero points (the same bytes, in chunk order).

    stages: the ring's chunks (17 rows of 512 bytes); splits: attention programs a KV head;
    tb: the tokens of K/V an attention program reads a block, a multiple of 32 (its first block
    before the wait for the qkv phase: 32 keeps contexts up to splits * 32 tokens to one block,
    each further block costing a round trip and a pass; see the benchmarks); `wait` (WAITS) the
    loader's form; `pre`: the projections read their groups' input sums, made once
    (`choose_placement` times both); `nbuf`: buffers for the projections' inputs (1:
    a projection's copies wait until the consumer warps are done with the one before's; 2
    measured slower in the engine's form, see the benchmarks). Shared memory a program: the
    ring, nbuf copies of the widest input (32 KB each for Llama-3-8B) and attention's query
    rows and K/V block (20 KB at tb 32): two programs an SM with 4 stages (90 KB a program
    with one copy), one with 8.

    The phase table's int64 fields: kind, chunk base, tiles, chunks a tile, input offset (in
    the arena), this phase's counters, the phase before's groups of outputs (0: no wait) and
    their counters, the tiles' sums of h^2 that 1 / rms is made from (-1: not normed), where
    this phase's go, the norm weight's offset, the layer's K and V cache offsets (elements from
    layer 0's), outputs a tile, the phase's first program (`place`) and the input's sums a row
    of 8 (in row_sums)."""

    def __init__(self, dims: Dims, layers: list[LayerWeights], final_norm: torch.Tensor,
                 device: torch.device, *, stages: int = PLACEMENTS[0][1], splits: int = 16,
                 tb: int = 32, programs: int | None = None) -> None:
        props = (torch.cuda.get_device_properties(device)
                 if torch.device(device).type == "cuda" else None)
        self.sms = props.multi_processor_count if props is not None else (programs or 1)
        if programs is None:
            programs = PLACEMENTS[0][0] * self.sms
        reason = unsupported(dims, layers, layers[0].qkv.scales.dtype if layers else
                             torch.bfloat16, programs, splits)
        if not layers:
            reason = "no layers"
        if reason is None and (tb <= 0 or tb % 32):
            reason = f"tb {tb} is not a positive multiple of 32 (attention's 4 warps x 8 tokens)"
        if reason is not None:
            raise ValueError(f"decode_rows: {reason}")
        self.dims, self.stages, self.splits, self.tb = dims, stages, splits, tb
        self.wait = "dataflow"
        H, L = dims.hidden, len(layers)
        self.k_max = max(dims.hidden, dims.heads * dims.head_dim, dims.inter)
        qkv_rows = qkv_order(dims.heads, dims.kv_heads, dims.head_dim).to(device)
        gu_rows = gate_up_rows(dims.inter).to(device)
        off = offsets(dims)
        x_in = {QKV: off["xn"], O: off["attn"], GU: off["xn"], DOWN: off["act"]}
        qd = dims.heads * dims.head_dim
        # where each projection's input's sums a row of 8 start (in row_sums)
        x_sums = {QKV: 0, O: H // 8, GU: 0, DOWN: (H + qd) // 8}
        projections = [(kind, w) for layer in layers
                       for kind, w in ((QKV, layer.qkv), (O, layer.o), (GU, layer.gate_up),
                                       (DOWN, layer.down))]
        chunks = sum(w.in_features // (128 * CG) * (w.out_features // TILE)
                     for _, w in projections)
        # NOTE: filled in place, so that packing needs the packed size once, not twice
        self.rows = torch.empty(17 * chunks, ROW, dtype=torch.int32, device=device)
        tiles_h = H // TILE
        # sums of h^2: the prologue's, then each layer's o and down tiles'
        self.sums = torch.zeros((1 + 2 * L) * tiles_h, dtype=torch.float32, device=device)
        q_groups = (dims.heads + 2 * dims.kv_heads) * dims.head_dim // 128
        per_layer = {QKV: q_groups, ATTN: dims.heads * dims.head_dim // 128, O: H // 128,
                     GU: dims.inter // 128, DOWN: H // 128}
        table = []
        chunk = cnt = 0
        prev_groups, prev_cnt, ss_last = 0, 0, 0  # (the prologue's: no wait)
        for f, (kind, w) in enumerate(projections):
            i = f // 4
            q, sc = w.qweight, w.scales
            zp = w.zeros if w.zeros is not None else torch.full_like(sc, 8.0)
            if kind in (QKV, GU):
                order = qkv_rows if kind == QKV else gu_rows
                q, sc, zp = q[:, order], sc[:, order], zp[:, order]
            n_chunks = w.in_features // (128 * CG)
            tiles = w.out_features // TILE
            self.rows[17 * chunk:17 * (chunk + tiles * n_chunks)] = pack(
                q.contiguous(), sc.contiguous(), zp.contiguous())
            ss_out = (1 + 2 * i + (kind == DOWN)) * tiles_h if kind in (O, DOWN) else 0
            ss_in = ss_last if kind in (QKV, GU) else -1
            g_off = {QKV: 0, O: 2 * i + 1, GU: 0, DOWN: 2 * i + 2}[kind] * H
            outs = TILE // 2 if kind == GU else TILE
            table.append([kind, chunk, tiles, n_chunks, x_in[kind], cnt, prev_groups, prev_cnt,
                          ss_in, ss_out, g_off, 0, 0, outs, 0, x_sums[kind]])
            prev_groups, prev_cnt = per_layer[kind], cnt
            # (every count a multiple of 4 where `unsupported` admits the shapes: each phase's
            # counters start at a multiple of 16 bytes, as the poll's loads need)
            cnt += per_layer[kind]
            if kind in (O, DOWN):
                ss_last = ss_out
            if kind == QKV:  # attention: waits on qkv's heads, counts o's input groups
                table.append([ATTN, 0, 0, 0, 0, cnt, q_groups, prev_cnt, -1] + [0] * 7)
                prev_groups, prev_cnt = per_layer[ATTN], cnt
                cnt += per_layer[ATTN]
            chunk += tiles * n_chunks
        self.norms = torch.cat([torch.cat([lw.norm_in, lw.norm_post]) for lw in layers]
                               + [final_norm]).to(torch.bfloat16)
        self.table = torch.tensor(table, dtype=torch.int64, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        self.apart = torch.empty(dims.kv_heads * splits * 4 * (dims.head_dim + 2), **f32)
        self.lock = torch.zeros(dims.kv_heads, dtype=torch.int32, device=device)
        self.cnt = torch.zeros(cnt + CNT_PAD, dtype=torch.int32, device=device)
        self.vec = torch.zeros(off["size"], dtype=torch.bfloat16, device=device)
        self.row_sums = torch.zeros((H + qd + dims.inter) // 8, **f32)
        self.zero_token = torch.zeros(1, dtype=torch.int64, device=device)
        self.caches: tuple[torch.Tensor, torch.Tensor] | None = None
        self._resident: set = set()
        self.pre = False
        self.nbuf = 1
        self.place(programs)
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        self.descs = (TensorDescriptor(self.rows, list(self.rows.shape),
                                       list(self.rows.stride()), [16, ROW], layout),
                      TensorDescriptor(self.rows, list(self.rows.shape),
                                       list(self.rows.stride()), [1, ROW], layout))

    def place(self, programs: int) -> None:
        """Run on `programs` programs (one an SM, or two where both fit at once: `__call__`
        checks before it launches), each phase's tiles rotated so that a layer's work is shared
        out evenly (`balance`)."""
        if programs < self.dims.kv_heads * self.splits:
            raise ValueError(f"decode_rows: {programs} programs, fewer than the attention's "
                             f"{self.dims.kv_heads * self.splits}")
        tab = self.table.cpu()
        firsts = balance([(int(r[2]), int(r[3])) if r[0] != ATTN
                          else (self.dims.kv_heads * self.splits, -1) for r in tab[:5]],
                         programs)
        tab[:, 14] = torch.tensor(firsts * (len(tab) // 5))
        self.table.copy_(tab)
        self.programs = programs

    def choose_placement(self, run, timer=None,
                         iters: int = 5) -> dict[tuple[int, int, bool], float]:
        """Time `run` (a call of this object on fixed inputs, caches bound) in each form of
        PLACEMENTS (programs an SM, ring stages, `pre`) and keep the fastest (inf where
        refused): the group sums made once speed the projections up but lengthen the
        chain between the phases, which wins depends on the GPU (see the benchmarks)."""
        return keep_fastest(PLACEMENTS, self._form, run, timer, iters)

    def _form(self, per_sm: int, stages: int, pre: bool) -> None:
        self.stages, self.pre = stages, pre
        self.place(per_sm * self.sms)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the packed copy of the weights."""
        return self.rows.numel() * 4

    def bind_caches(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each layer's (k_cache, v_cache), (blocks, block_size, kv_heads, head_dim) bf16: their
        element offsets from layer 0's go into the table. Attention copies their rows 16 bytes
        at a time: every cache must start at a multiple of 16 bytes."""
        from peregrine.kernels.decode_layers import check_caches
        offs = check_caches(self.dims, caches, len(self.table) // 5, "decode_rows")
        if caches and (caches[0][0].data_ptr() % 16 or caches[0][1].data_ptr() % 16
                       or bool((offs % 8).any())):
            raise ValueError("decode_rows: every layer's K and V cache must start at a "
                             "multiple of 16 bytes")
        self.table[:, 11:13] = offs.repeat_interleave(5, 0)
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
            raise RuntimeError("decode_rows: bind_caches first")
        d = self.dims
        H = d.hidden
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != H or not x.is_contiguous():
            raise ValueError(f"decode_rows: the input {tuple(x.shape)} {x.dtype} is not a "
                             f"contiguous bf16 (rows, {H})")
        if token is None:
            token = self.zero_token
        rows_prologue_kernel[(H // 128,)](
            x, token, self.norms, self.vec, self.sums, self.row_sums, self.lock, self.cnt,
            self.lock.numel(), self.cnt.numel(), H=H, num_warps=4)
        k0, v0 = self.caches
        gmax = 1 << (self.k_max // 128 - 1).bit_length()  # (shared shapes: powers of 2)
        args = (*self.descs, self.table, len(self.table), self.vec, self.norms, self.sums,
                self.row_sums, self.apart, self.lock, self.cnt, cos_sin, positions, slot_mapping,
                block_table, k0, v0, d.eps, 1.0 / math.sqrt(d.head_dim), self.programs)
        kw = dict(S=self.stages, GMAX=gmax, CMAX=gmax // CG, H=H, HEADS=d.heads,
                  KVH=d.kv_heads, D=d.head_dim, BS=d.block_size, SPLITS=self.splits, TB=self.tb,
                  MODE=WAITS[self.wait], PRE=int(self.pre), NBUF=self.nbuf,
                  NPH=max(32, 1 << (len(self.table) - 1).bit_length()),
                  HT=1 << (-(-(H // TILE) // self.programs) - 1).bit_length(),
                  num_warps=4, maxnreg=128)
        check_resident(decode_rows_kernel, self.programs, self.sms, args, kw, self._resident,
                       "decode_rows")
        decode_rows_kernel[(self.programs,)](*args, **kw)
        return self.vec[:H].view(1, H)
