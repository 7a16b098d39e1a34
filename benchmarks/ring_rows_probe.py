"""Would whole-K row tiles and per-group readiness take the phase tails out of the persistent
decode kernel?

The persistent decode kernel (kernels/decode_layers.py) shares each projection's (tile of 128
channels, group of 128 inputs) units out evenly over the programs (stream-K): a tile's pieces
lie in several programs, which store float32 partials and take a ticket, the last adding them;
each phase then counts its programs done and the next phase waits for all of them. Per GEMV
phase that is about 4 us besides the weight stream (the partials' round trips, the finish, the
count and its poll, and programs ending 0.5-2 us apart), while the consumer warps wait.

This probe times the other way to cut the work, on the same four GEMV phases of 32 Llama-3-8B
layers (qkv, o, gate/up, down; real 4-bit weights with scales and zero points, every output
checked against x @ dequant(W)):
- a tile is 16 channels and a program takes whole tiles, every group of their K, so no tile
  is split across programs: no partials, no tickets, no finish; tiles go to programs round
  robin (tile p, p + P, ...), so a phase's tiles complete in order of their index;
- the four consumer warps of a program split a tile's K between them (a chunk is 8 groups of
  one tile, 2 a warp) and add their sums through shared memory at the tile's end;
- a tile's owner writes its 16 outputs and adds 16 (release) to its group of 128 outputs'
  counter; a third partition of the kernel, one warp, copies the next phase's input into a
  shared-memory buffer (two, alternating between phases) chunk by chunk as soon as the groups
  that chunk reads are complete (`dataflow`), or after every group of the phase before is
  (`phase`), or without waiting (`free`: the stream and the MMAs alone, the floor of the form);
- `_pre` forms: the copying warp also writes each group's input sum once, so that a consumer
  step is two MMAs on its words alone (no constant-weight MMAs).

The phases' inputs are fixed rows (not the outputs before them); phase f's input group j
waits for the groups of phase f - 1's outputs at the same fraction of its width (qkv stands in
for attention before o). Attention, the norms and the residual are left out.

    python benchmarks/ring_rows_probe.py --out /tmp/out/rows.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_replay_ms, write_results  # noqa: E402
from benchmarks.ring_int4_probe import _ulps  # noqa: E402
from peregrine.kernels._gluon import (cp_async, cta_barrier, ring_barriers,  # noqa: E402
                                      smem_reinterpret, tma_load)
from peregrine.kernels.decode_rows import (CG, CNT_PAD, ROW, TILE, _chunk,  # noqa: E402
                                           _chunk_done, _ready_groups, pack)
from peregrine.kernels.wna16_gemv_tc import _f32_hi, _f32_lo  # noqa: E402

HBM_GBPS = 4200.0
PROJ = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096))
TAB = gl.constexpr(10)
_TILE = gl.constexpr(TILE)
_ROW = gl.constexpr(ROW)
# table fields: chunk base, tiles, chunks a tile, N, input offset, output offset, this phase's
# counters' offset, the phase before's groups of outputs, their counters' offset
# form: (how the input waits, the group sums made once by the copying warp)
MODES = {"dataflow": (1, False), "phase": (0, False), "free": (2, False),
         "dataflow_pre": (1, True), "phase_pre": (0, True), "free_pre": (2, True)}


@gluon.jit
def _tab(tab_ptr, f, j: gl.constexpr):
    return gl.load(tab_ptr + f * TAB + j).to(gl.int32)


@gluon.jit
def _producer(desc_w, desc_s, wbufs, sbufs, ready, empty, tab_ptr, n_phases, P,
              S: gl.constexpr):
    """The program's tiles of every phase, chunk by chunk, into the next free slot."""
    pid = gl.program_id(0)
    i = 0
    for f in range(n_phases):
        base = _tab(tab_ptr, f, 0)
        tiles = _tab(tab_ptr, f, 1)
        C = _tab(tab_ptr, f, 2)
        for tile in range(pid, tiles, P):
            for c in range(C):
                slot = i % S
                mbarrier.wait(empty.index(slot), ((i // S) & 1) ^ 1)
                mbarrier.expect(ready.index(slot), 17 * _ROW * 4)
                row = (base + tile * C + c) * 17
                tma_load(desc_w, [row, 0], ready.index(slot), wbufs.index(slot))
                tma_load(desc_s, [row + 16, 0], ready.index(slot), sbufs.index(slot))
                i += 1


@gluon.jit
def _pre_chunk(blocks, xsums, blk, row, LC: gl.constexpr):
    """A chunk's 8 groups' input sums (16 rows each, from its x copy: blocks blk .. blk + 3 of
    32 rows, lane r holding row r of each) at xsums[row][gi]."""
    LS: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
    view = smem_reinterpret(xsums, gl.float32, [xsums.shape[0], 32],
                            gl.SwizzledSharedLayout(1, 1, 1, [0])).index(row)
    for q in gl.static_range(4):
        v = blocks.index(blk + q).load(LC)
        a, c = gl.split(gl.reshape(v, [32, 2, 2]))
        w0, w2 = gl.split(a)
        w1, w3 = gl.split(c)
        rs = (_f32_lo(w0, True) + _f32_hi(w0, True) + _f32_lo(w1, True) + _f32_hi(w1, True)
              + _f32_lo(w2, True) + _f32_hi(w2, True) + _f32_lo(w3, True) + _f32_hi(w3, True))
        gs = gl.sum(gl.reshape(rs, [2, 16]), 1)  # groups 2q, 2q + 1 of the chunk
        view.slice(2 * q, 2, dim=0).store(gl.convert_layout(gs, LS))


@gluon.jit
def _loader(xbufs, xsums, xready, xfree, tab_ptr, n_phases, x_ptr, cnt_ptr,
            CMAX: gl.constexpr, MODE: gl.constexpr, PRE: gl.constexpr):
    """Each phase's input row into buffer f % 2, a chunk's 8 groups at a time, as soon as the
    groups of the phase before that they stand for are complete (MODE 1; 0: once all of them
    are; 2: no wait): xready[f % 2][c] says chunk c's groups have landed. A pass reads up to
    128 counters at once and copies every chunk they make ready, in one round trip. PRE: each
    group's input sum written into xsums (group gi of a chunk at gi of its row), so that the
    consumers do not make it."""
    LC: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [1, 1], [1, 0])
    LG: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
    r = gl.arange(0, 32, layout=gl.SliceLayout(1, LC))
    w = gl.arange(0, 4, layout=gl.SliceLayout(0, LC))
    off = gl.expand_dims(r, 1) * 4 + gl.expand_dims(w, 0)
    src0 = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    NB: gl.constexpr = xbufs.shape[1] // 32  # blocks of 32 rows a buffer
    blocks = smem_reinterpret(xbufs, gl.int32, [2 * NB, 32, 4],
                              gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    for f in range(n_phases):
        C = _tab(tab_ptr, f, 2)
        x_off = _tab(tab_ptr, f, 4)
        gp = _tab(tab_ptr, f, 7)
        pcnt = _tab(tab_ptr, f, 8)
        b = f % 2
        mbarrier.wait(xfree.index(b), ((f // 2) & 1) ^ 1)
        G = C * 8
        done = 0
        passes = 0
        while done < C:
            if (MODE == 2) or (gp == 0):
                upto = C
            elif MODE == 0:  # (up to 128 groups, a phase's most here: 224 / 2 a pass)
                avail = _ready_groups(cnt_ptr + pcnt, 0, gp, LG)
                avail = gl.where(avail >= 128, _ready_groups(cnt_ptr + pcnt, 128, gp, LG), avail)
                upto = gl.where(avail >= gp, C, 0)
            else:
                avail = _ready_groups(cnt_ptr + pcnt, (8 * done * gp) // G, gp, LG)
                upto = gl.minimum(C, (avail * G) // (8 * gp))
            for c in range(done, upto):  # the chunk's 8 groups: 128 rows of 16 B
                src = src0 + gl.multiple_of(x_off // 2 + c * 512, 64) + off
                for q in gl.static_range(4):
                    cp_async(blocks.index(b * NB + 4 * c + q), src + q * 128,
                             cache_modifier=".cg")
            async_copy.commit_group()
            async_copy.wait_group(0)
            if PRE:  # (a lane rewrites the rows it copied: its own copies have landed)
                for c in range(done, upto):
                    _pre_chunk(blocks, xsums, b * NB + 4 * c, b * CMAX + c, LC)
            for c in range(done, upto):
                mbarrier.arrive(xready.index(b * CMAX + c), count=1)
            done = gl.maximum(done, upto)
            passes += 1
            if passes > (1 << 24):  # a phase that never completes: fail, do not hang
                gl.inline_asm_elementwise("trap; // $0", "=r", [], dtype=gl.int32,
                                          is_pure=False, pack=1)
        for c in range(C, CMAX):  # (every barrier of the buffer completes once a use)
            mbarrier.arrive(xready.index(b * CMAX + c), count=1)


@gluon.jit
def _consumer(wbufs, sbufs, xbufs, xsums, ready, empty, xready, xfree, tab_ptr, n_phases,
              out_ptr, cnt_ptr, P, S: gl.constexpr, CMAX: gl.constexpr, GMAX: gl.constexpr,
              PRE: gl.constexpr):
    """The program's tiles of every phase: each chunk's 8 groups over the four warps (2 each),
    the warps' sums added at the tile's end, its 16 outputs stored and its group's counter
    counted up (release); x from the copying warp's buffer, waited for chunk by chunk on the
    phase's first tile."""
    WARPS: gl.constexpr = 4
    T: gl.constexpr = 32 * WARPS
    L: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    LT: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    pid = gl.program_id(0)
    idx = gl.arange(0, T, layout=L)
    lane = idx % 32
    g = lane // 4
    t = lane % 4
    sel = gl.where(t % 2 == 0, 0x4140, 0x4342)  # (6-bit weights only; _step's argument)
    zero = gl.zeros([T], gl.float32, layout=L)
    ones = gl.full([T], 0x3F803F80, gl.int32, layout=L)  # bf16 1.0 pairs
    ch = gl.arange(0, 8, layout=LT)  # a tile's channel pairs
    # views of the whole buffers (a view of one slot cannot be reinterpreted)
    xv = smem_reinterpret(xbufs, gl.int32, [2 * (GMAX // 8), WARPS, 2, 16, 4],
                          gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
    wvs = smem_reinterpret(wbufs, gl.int32, [S, WARPS, 2, 4, 64],
                           gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
    svs = smem_reinterpret(sbufs, gl.int32, [S, T], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    xsv = smem_reinterpret(xsums, gl.float32, [2 * CMAX, 32],
                           gl.SwizzledSharedLayout(1, 1, 1, [0]))
    i = 0
    for f in range(n_phases):
        tiles = _tab(tab_ptr, f, 1)
        C = _tab(tab_ptr, f, 2)
        o_off = _tab(tab_ptr, f, 5)
        cnt_off = _tab(tab_ptr, f, 6)
        b = f % 2
        for tile in range(pid, tiles, P):
            y = (zero, zero, zero, zero, zero, zero, zero, zero)
            for c in range(C):
                if tile == pid:
                    mbarrier.wait(xready.index(b * CMAX + c), (f // 2) & 1)
                slot = i % S
                mbarrier.wait(ready.index(slot), (i // S) & 1)
                # (PRE: its groups' sums beside the copy)
                y = _chunk_done(y, _chunk(wvs.index(slot), xv.index(b * (GMAX // 8) + c), ones,
                                          sel, L, T, WARPS, PRE),
                                svs.index(slot).load(L), g, L, T, WARPS, PRE,
                                xsv.index(b * CMAX + c), idx // 32)
                # every warp's reads of the slot are ordered before the TMA that refills it
                # (a proxy fence), then a barrier of the consumer warps and one thread's arrive
                fence_async_shared()
                mbarrier.arrive(empty.index(slot), count=1)
                i += 1
            # the warps' sums of the tile's channels 2g (y[0]) and 2g + 1 (y[4]), equal in a
            # quad's four lanes, added over the warps
            v0 = gl.max(gl.reshape(y[0], [WARPS, 8, 4]), 2)
            v1 = gl.max(gl.reshape(y[4], [WARPS, 8, 4]), 2)
            n0 = tile * _TILE
            gl.store(out_ptr + o_off + n0 + 2 * ch, gl.convert_layout(gl.sum(v0, 0), LT)
                     .to(gl.bfloat16))
            gl.store(out_ptr + o_off + n0 + 2 * ch + 1, gl.convert_layout(gl.sum(v1, 0), LT)
                     .to(gl.bfloat16))
            cta_barrier()
            # (a group's count is its outputs written, as the decode kernel's)
            gl.atomic_add(cnt_ptr + cnt_off + n0 // 128, _TILE, sem="release", scope="gpu")
        mbarrier.arrive(xfree.index(b), count=1)


@gluon.jit
def ring_rows_kernel(desc_w, desc_s, tab_ptr, n_phases, x_ptr, out_ptr, cnt_ptr, P,
                     S: gl.constexpr, GMAX: gl.constexpr, CMAX: gl.constexpr,
                     MODE: gl.constexpr, PRE: gl.constexpr = False):
    wbufs = gl.allocate_shared_memory(gl.int32, [S, 16, _ROW], desc_w.layout)
    sbufs = gl.allocate_shared_memory(gl.int32, [S, 1, _ROW], desc_s.layout)
    xbufs = gl.allocate_shared_memory(gl.int32, [2, GMAX * 16, 4],
                                      gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    xsums = gl.allocate_shared_memory(gl.float32, [2 * CMAX, 32],
                                      gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready, empty = ring_barriers(S)
    xready = gl.allocate_shared_memory(gl.int64, [2 * CMAX, 1], mbarrier.MBarrierLayout())
    xfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(2 * CMAX):
        mbarrier.init(xready.index(j), count=1)
    for j in gl.static_range(2):
        mbarrier.init(xfree.index(j), count=1)
    gl.warp_specialize([
        (_consumer, (wbufs, sbufs, xbufs, xsums, ready, empty, xready, xfree, tab_ptr,
                     n_phases, out_ptr, cnt_ptr, P, S, CMAX, GMAX, PRE)),
        (_producer, (desc_w, desc_s, wbufs, sbufs, ready, empty, tab_ptr, n_phases, P, S)),
        (_loader, (xbufs, xsums, xready, xfree, tab_ptr, n_phases, x_ptr, cnt_ptr, CMAX, MODE,
                   PRE)),
    ], [1, 1], [48, 80])


def build(layers: int, P: int, dev: torch.device, proj=PROJ):
    """Random 4-bit weights (scales, zero points) of `layers` layers, packed (`pack`), the
    inputs, and the phase table (int64, TAB fields a phase) for P programs."""
    from peregrine.layers.quantization.wna16 import WNA16Layout
    layouts, packed, xs, table = [], [], [], []
    chunk = x_off = o_off = c_off = 0
    prev = None  # the phase before's (groups of outputs, counters' offset)
    for _ in range(layers):
        for _, k, n in proj:
            q = torch.randint(0, 16, (k, n), device=dev, dtype=torch.int32)
            sc = torch.rand(k // 128, n, device=dev) * 0.01 + 0.002
            zp = torch.randint(0, 16, (k // 128, n), device=dev).float()
            w = WNA16Layout.build(q, sc, zp, None, 4, torch.bfloat16)
            del q
            layouts.append(w)
            packed.append(pack(w.qweight, w.scales, w.zeros))
            xs.append(torch.randn(k, device=dev).to(torch.bfloat16))
            tiles, chunks = n // TILE, k // (128 * CG)
            gp, pcnt = prev if prev else (0, 0)
            table.append([chunk, tiles, chunks, n, x_off, o_off, c_off, gp, pcnt, 0])
            prev = (n // 128, c_off)
            chunk += tiles * chunks
            x_off += k
            o_off += n
            c_off += n // 128
    return {"layouts": layouts, "rows": torch.cat(packed), "x": torch.cat(xs), "xs": xs,
            "out_n": o_off, "counters": c_off,
            "table": torch.tensor(table, dtype=torch.int64, device=dev)}


def run(layers: int, per_sm: int, stages: int, iters: int, modes: list[str],
        dev: torch.device) -> dict:
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    P = sms * per_sm
    d = build(layers, P, dev)
    rows = d["rows"]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    desc_w = TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [16, ROW], layout)
    desc_s = TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [1, ROW], layout)
    table = d["table"]
    n_phases = table.shape[0]
    gmax = 1 << (max(k for _, k, _ in PROJ) // 128 - 1).bit_length()  # (shapes: powers of 2)
    cmax = gmax // CG
    cnt = torch.zeros(d["counters"] + CNT_PAD, dtype=torch.int32, device=dev)
    out = torch.zeros(d["out_n"], dtype=torch.bfloat16, device=dev)
    weight_bytes = rows.numel() * 4 / layers
    result = {"layers": layers, "programs": P, "per_sm": per_sm, "stages": stages,
              "weight_bytes_per_layer": weight_bytes,
              "wall_us_per_layer": round(weight_bytes / (HBM_GBPS * 1e3), 2)}
    t0 = time.time()
    for name in modes:
        def call():
            cnt.zero_()
            ring_rows_kernel[(P,)](desc_w, desc_s, table, n_phases, d["x"], out, cnt, P,
                                   S=stages, GMAX=gmax, CMAX=cmax, MODE=MODES[name][0],
                                   PRE=MODES[name][1],
                                   num_warps=4, maxnreg=128)
        out.zero_()
        call()
        torch.cuda.synchronize()
        err = 0.0
        for j, w in enumerate(d["layouts"]):
            o0, n = int(table[j, 5]), w.out_features
            err = max(err, _ulps(out[o0:o0 + n], d["xs"][j], w))
        assert err <= 1.0, f"{name}: {err:.2f} output ulps from the exact product"
        ms = graph_replay_ms([call], iters)
        result[name] = {"us_per_layer": round(ms * 1e3 / layers, 2), "max_ulps": round(err, 3)}
        print(f"{per_sm} an SM, ring {stages}: {name:9s} {ms * 1e3 / layers:7.2f} us a layer "
              f"(wall {result['wall_us_per_layer']:.2f}; ulps {err:.3f})  "
              f"({time.time() - t0:.0f} s)", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--configs", default="1x8,2x4",
                   help="programs an SM x ring stages, comma-separated")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--iters", type=int, default=20)
    ns = p.parse_args()
    dev = torch.device("cuda")
    results = []
    for cfg in ns.configs.split(","):
        per_sm, stages = (int(v) for v in cfg.split("x"))
        results.append(run(ns.layers, per_sm, stages, ns.iters, ns.modes.split(","), dev))
        torch.cuda.empty_cache()
    write_results(ns.out, dev, results)


if __name__ == "__main__":
    main()
