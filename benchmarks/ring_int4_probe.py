"""Do the real int4 MMAs keep up with a TMA weight ring in one persistent decode kernel?

`ring_stream_probe.py` measured the design with stand-ins: one program an SM, a producer warp
copying the program's share of every GEMV's weight into a shared-memory ring by TMA, consumer
warps walking the phases; a layer's four GEMV phases (each waiting for the one before) streamed
at 29.4-30.0 us a layer against the kernel-a-phase chain's 47.1. The stand-in consumers only sum
the words. Here the consumers do the int4 tensor-core GEMV's own work (wna16_gemv_tc.py: each
lane's words from the chunk as the MMAs take them, the magic-offset conversion, the MMAs, the
zero point and scale once a group, the split epilogue), on real 4-bit weights with scales and
zero points, so the number is what the persistent layer's GEMV phases would give (the piece of
work is kernels/ring_gemv.py's, which the persistent decode kernel runs).

The weights are repacked so that each (tile of 32 x WARPS channels, group of 128 inputs) unit is
one contiguous chunk of 16 word rows (the layout's own words, value j of a word in bits 4j), so
one TMA descriptor covers every layer and projection. A phase's units, tile-major, are shared
out evenly (stream-K); a tile's pieces add their float32 partials, the last to arrive adding
them in order. Each phase then counts its programs done (a release add), and the next phase's
consumers wait for all of them (acquire polls); its input row is read after that wait, through
L2. The scales and zero points are read from global memory a group ahead, as the tc kernel
reads them.

Forms (CUDA-graph replays of 32 Llama-3-8B layers, qkv, o, gate/up, down; every output checked
against x @ dequant(W) in float32):
- `ring_mma`: as above;
- `ring_mma_acc2`: two sets of accumulators, even and odd steps (half the MMA chain a warp);
- `ring_mma_xs` / `ring_mma_acc2_xs`: the input row copied into shared memory once a phase
  (cp.async) and read from there, no step waiting on L2;
- `ring_sum`: the same shares, waits and stream, the consumer only summing the words (the
  stand-in, for comparison on this machine);
- `tc_chain`: the engine's int4 tensor-core GEMV, a kernel a projection, dependent launches.

    python benchmarks/ring_int4_probe.py --out /tmp/out/ring_int4.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_replay_ms, write_results  # noqa: E402
from peregrine.kernels._gluon import cta_barrier, ring_barriers, tma_load  # noqa: E402
from peregrine.kernels._gluon import poll_acquire as _poll  # noqa: E402
from peregrine.kernels.ring_gemv import (_gemv_piece, _share, _tile_sum, _x_to_smem,  # noqa: E402
                                         share, tile_words, word_layout, x_groups)

HBM_GBPS = 4200.0
# Llama-3-8B's projections at one decode row: (name, K, N)
PROJ = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096))
# int64 fields a phase: row base, units a program, units, groups, N, scale, input and output offsets
TAB = gl.constexpr(8)
# form: (the MMAs, two sets of accumulators, x from a shared-memory copy)
FORMS = {"ring_mma": (True, False, False), "ring_mma_acc2": (True, True, False),
         "ring_mma_xs": (True, False, True), "ring_mma_acc2_xs": (True, True, True),
         "ring_sum": (False, False, False)}


@gluon.jit
def _producer(desc, bufs, ready, empty, tab_ptr, n_phases, S: gl.constexpr, T: gl.constexpr):
    """Every phase's units of this program in order, a chunk (16 word rows of T channels) each,
    into the next free slot."""
    pid = gl.program_id(0)
    i = 0
    for f in range(n_phases):
        base = gl.load(tab_ptr + f * TAB).to(gl.int32)
        W = gl.load(tab_ptr + f * TAB + 1).to(gl.int32)
        total = gl.load(tab_ptr + f * TAB + 2).to(gl.int32)
        start, end = _share(pid, W, total)
        for u in range(start, end):
            slot = i % S
            mbarrier.wait(empty.index(slot), ((i // S) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), 16 * T * 4)
            tma_load(desc, [base + u * 16, 0], ready.index(slot), bufs.index(slot))
            i += 1


@gluon.jit
def _consumer(bufs, xs, ready, empty, tab_ptr, n_phases, s_ptr, z_ptr, x_ptr, out_ptr, part_ptr,
              lock_ptr, cnt_ptr, sink_ptr, P, S: gl.constexpr, WARPS: gl.constexpr,
              MATH: gl.constexpr, ACC2: gl.constexpr, X_AHEAD: gl.constexpr,
              XS: gl.constexpr):
    T: gl.constexpr = 32 * WARPS
    L: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    LW: gl.constexpr = word_layout(WARPS)
    pid = gl.program_id(0)
    idx = gl.arange(0, T, layout=L)
    lane = idx % 32
    g = lane // 4
    t = lane % 4
    sel = gl.where(t % 2 == 0, 0x4140, 0x4342)  # (6-bit weights only; _step's argument)
    zero = gl.zeros([T], gl.float32, layout=L)
    izero = gl.zeros([4, T], gl.int32, layout=LW)
    ones = gl.full([T], 0x3F803F80, gl.int32, layout=L)  # bf16 1.0 pairs
    sink = izero
    i = 0
    for f in range(n_phases):
        W = gl.load(tab_ptr + f * TAB + 1).to(gl.int32)
        total = gl.load(tab_ptr + f * TAB + 2).to(gl.int32)
        CHUNKS = gl.load(tab_ptr + f * TAB + 3).to(gl.int32)
        N = gl.load(tab_ptr + f * TAB + 4).to(gl.int32)
        s_off = gl.load(tab_ptr + f * TAB + 5)
        x_off = gl.load(tab_ptr + f * TAB + 6)
        o_off = gl.load(tab_ptr + f * TAB + 7)
        if f > 0:  # every program of the phase before is done
            seen = _poll(cnt_ptr + (f - 1))
            while seen < P:
                seen = _poll(cnt_ptr + (f - 1))
        start, end = _share(pid, W, total)
        if XS and start < end:
            _x_to_smem(xs, x_ptr, x_off, CHUNKS, T, WARPS)
        u = start
        while u < end:  # one piece a pass: the program's groups of one tile
            if MATH:
                i, done, j, n_pieces = _gemv_piece(
                    bufs, bufs, ready, empty, i, u, end, CHUNKS, N, W, s_ptr, z_ptr, s_off,
                    x_ptr.to(gl.int64) + x_off * 2, part_ptr, pid, idx, t, g, zero, ones, sel,
                    LW, L, T, S, X_AHEAD, 0, WARPS, ACC2, xs, XS)
                # NOTE: every thread's partial stores come before the ticket (barrier), and the
                # ticket is a gpu-scope acq_rel atomic, so the last piece sees all partials.
                cta_barrier()
                ticket = gl.atomic_add(lock_ptr + j, 1, sem="acq_rel", scope="gpu")
                if ticket == n_pieces - 1:
                    n = j * T + idx
                    y = _tile_sum(part_ptr, n_pieces, N, n)
                    gl.store(out_ptr + o_off + n, y.to(gl.bfloat16))
                    gl.atomic_xchg(lock_ptr + j, 0)
            else:
                done = gl.minimum(CHUNKS - u % CHUNKS, end - u)
                for c in range(done):
                    slot = i % S
                    mbarrier.wait(ready.index(slot), (i // S) & 1)
                    buf = bufs.index(slot)
                    for s in gl.static_range(4):
                        sink += buf.slice(s * 4, 4, dim=0).load(LW)
                    cta_barrier()
                    fence_async_shared()
                    mbarrier.arrive(empty.index(slot), count=1)
                    i += 1
            u += done
        cta_barrier()
        gl.atomic_add(cnt_ptr + f, 1, sem="release", scope="gpu")
    if not MATH:
        gl.store(sink_ptr + pid, gl.sum(gl.sum(sink, 1), 0))


@gluon.jit
def ring_int4_kernel(desc, tab_ptr, n_phases, s_ptr, z_ptr, x_ptr, out_ptr, part_ptr, lock_ptr,
                     cnt_ptr, sink_ptr, P, S: gl.constexpr, WARPS: gl.constexpr,
                     MATH: gl.constexpr, ACC2: gl.constexpr, X_AHEAD: gl.constexpr,
                     XS: gl.constexpr = False, NG: gl.constexpr = 8):
    T: gl.constexpr = 32 * WARPS
    bufs = gl.allocate_shared_memory(gl.int32, [S, 16, T], desc.layout)
    xs = gl.allocate_shared_memory(gl.int32, [NG, 16, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ready, empty = ring_barriers(S)
    gl.warp_specialize([
        (_consumer, (bufs, xs, ready, empty, tab_ptr, n_phases, s_ptr, z_ptr, x_ptr, out_ptr,
                     part_ptr, lock_ptr, cnt_ptr, sink_ptr, P, S, WARPS, MATH, ACC2, X_AHEAD,
                     XS)),
        (_producer, (desc, bufs, ready, empty, tab_ptr, n_phases, S, T)),
    ], [1], [48])


def build(layers: int, warps: int, P: int, dev: torch.device, proj=PROJ):
    """Random 4-bit weights (scales, zero points) of `layers` layers of the projections proj,
    in the engine's layout and tiled; inputs; the phase table (int64, TAB fields a phase) for
    P programs."""
    from peregrine.layers.quantization.wna16 import WNA16Layout
    tile = 32 * warps
    layouts, tiled, scales, zeros, xs, table = [], [], [], [], [], []
    row = s_off = x_off = o_off = 0
    for _ in range(layers):
        per = []
        for _, k, n in proj:
            q = torch.randint(0, 16, (k, n), device=dev, dtype=torch.int32)
            sc = torch.rand(k // 128, n, device=dev) * 0.01 + 0.002
            zp = torch.randint(0, 16, (k // 128, n), device=dev).float()
            w = WNA16Layout.build(q, sc, zp, None, 4, torch.bfloat16)
            del q
            per.append(w)
            tiled.append(tile_words(w.qweight, tile))
            scales.append(w.scales.reshape(-1))
            zeros.append(w.zeros.reshape(-1))
            xs.append(torch.randn(k, device=dev).to(torch.bfloat16))
            groups, tiles = k // 128, n // tile
            table.append([row, share(tiles, groups, P), tiles * groups, groups, n, s_off, x_off,
                          o_off])
            row += tiles * groups * 16
            s_off += groups * n
            x_off += k
            o_off += n
        layouts.append(per)
    return {"layouts": layouts, "words": torch.cat(tiled), "scales": torch.cat(scales),
            "zeros": torch.cat(zeros), "x": torch.cat(xs), "xs": xs, "out_n": o_off,
            "table": torch.tensor(table, dtype=torch.int64, device=dev)}


def _ulps(got: torch.Tensor, x: torch.Tensor, w) -> float:
    """The largest |got - x @ dequant(w)| in output ulps at the reference's magnitude (at least
    its RMS's)."""
    want = x.float()[None] @ w.dequantize(torch.float32).t()
    unit = torch.maximum(want.abs(), want.pow(2).mean().sqrt()) * torch.finfo(x.dtype).eps
    return ((got.float() - want).abs() / unit).max().item()


def run(layers: int, warps: int, stages: int, x_ahead: int, iters: int, forms: list[str],
        dev: torch.device) -> dict:
    from peregrine.kernels.wna16_gemv import wna16_gemv
    P = torch.cuda.get_device_properties(dev).multi_processor_count
    d = build(layers, warps, P, dev)
    tile = 32 * warps
    words = d["words"]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    desc = TensorDescriptor(words, list(words.shape), list(words.stride()), [16, tile], layout)
    table = d["table"]
    n_phases = table.shape[0]
    max_n = max(n for _, _, n in PROJ)
    pieces = int(max(-(-r[3] // r[1]) + 1 for r in table.tolist()))
    part = torch.empty(pieces * max_n, dtype=torch.float32, device=dev)
    lock = torch.zeros(max_n // tile, dtype=torch.int32, device=dev)
    cnt = torch.zeros(n_phases, dtype=torch.int32, device=dev)
    sink = torch.zeros(P, dtype=torch.int32, device=dev)
    out = torch.zeros(d["out_n"], dtype=torch.bfloat16, device=dev)
    weight_bytes = (words.numel() * 4 + d["scales"].numel() * 4) / layers
    result = {"layers": layers, "warps": warps, "stages": stages, "x_ahead": x_ahead,
              "programs": P, "chunk_bytes": 16 * tile * 4, "ring_bytes": stages * 16 * tile * 4,
              "weight_bytes_per_layer": weight_bytes,
              "wall_us_per_layer": round(weight_bytes / (HBM_GBPS * 1e3), 2)}
    regs = min(128, 65536 // ((warps + 4) * 32) // 8 * 8)
    t0 = time.time()
    for name in forms:
        if name == "tc_chain":
            ys = []

            def call():
                ys.clear()
                for j, w in enumerate(sum(d["layouts"], [])):
                    ys.append(wna16_gemv(d["xs"][j][None], w))
            call()
            torch.cuda.synchronize()
            err = max(_ulps(ys[j], d["xs"][j], w)
                      for j, w in enumerate(sum(d["layouts"], [])) if j % 13 == 0)
        else:
            math, acc2, x_smem = FORMS[name]
            ng = x_groups(max(k for _, k, _ in PROJ), tile) if x_smem else tile // 16

            def call():
                cnt.zero_()
                ring_int4_kernel[(P,)](desc, table, n_phases, d["scales"], d["zeros"], d["x"],
                                       out, part, lock, cnt, sink, P, S=stages, WARPS=warps,
                                       MATH=math, ACC2=acc2, X_AHEAD=x_ahead, XS=x_smem,
                                       NG=ng, num_warps=warps, maxnreg=regs)
            out.zero_()
            call()
            torch.cuda.synchronize()
            err = None
            if math:
                err = 0.0
                for j, w in enumerate(sum(d["layouts"], [])):
                    o0, n = int(table[j, 7]), w.out_features
                    err = max(err, _ulps(out[o0:o0 + n], d["xs"][j], w))
                assert err <= 1.0, f"{name}: {err:.2f} output ulps from the exact product"
        ms = graph_replay_ms([call], iters)
        result[name] = {"us_per_layer": round(ms * 1e3 / layers, 2),
                        "max_ulps": None if err is None else round(err, 3)}
        print(f"warps {warps}, ring {stages} x {16 * tile * 4 // 1024} KB, x ahead {x_ahead}: "
              f"{name:14s} {ms * 1e3 / layers:7.2f} us a layer (wall "
              f"{result['wall_us_per_layer']:.2f}; ulps {err})  ({time.time() - t0:.0f} s)",
              flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--configs", default="4x16x4,8x8x4",
                   help="consumer warps x ring stages x x-ahead steps, comma-separated")
    p.add_argument("--forms", default="ring_mma,ring_mma_acc2,ring_mma_xs,ring_mma_acc2_xs,"
                   "ring_sum,tc_chain")
    p.add_argument("--iters", type=int, default=20)
    ns = p.parse_args()
    dev = torch.device("cuda")
    results = []
    for cfg in ns.configs.split(","):
        w, s, xa = (int(v) for v in cfg.split("x"))
        results.append(run(ns.layers, w, s, xa, ns.iters, ns.forms.split(","), dev))
        torch.cuda.empty_cache()
    write_results(ns.out, dev, results)


if __name__ == "__main__":
    main()
