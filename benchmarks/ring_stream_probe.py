"""Would one persistent decode kernel whose weights stream through a shared-memory ring, apart
from the phases' dependencies, keep HBM busy through a layer's short phases?

The kernel-a-phase chain costs ~1.6-1.8 us a boundary, and a persistent kernel whose programs
stream their own weights and meet at grid barriers lost to it (`layer_barrier_probe.py`): while
the programs wait at a barrier, nothing reads HBM. Here each program (one an SM) splits in two:
one producer warp copies the program's share of every GEMV's weight, in the order the layer
uses them, into a ring of shared-memory chunks by TMA, waiting only for a free chunk; four
consumer warps walk the phases (the same stand-ins as the barrier probe: RMSNorm, qkv,
RoPE/store, attention split and merge, o, RMSNorm, gate/up, SiLU-and-mul, down), each phase
waiting until the programs of the phase before it have counted themselves done (a release add on
that phase's counter, polled with acquire loads), a GEMV phase summing its chunks as they land.
So the weight stream runs through the waits, as long as the ring has room.

Forms (CUDA-graph replays of 32 Llama-3-8B layers, weights laid out so that each program's
chunks of a phase are contiguous, every phase's bytes rounded up to whole chunks an SM):
- `ring`: the phases with their dependencies;
- `ring_free`: the same kernel with no waits (the stream and the short phases' own work only);
  the floor this design allows;
- `ring_flags`: each program sets a flag of its own instead of adding to one counter, and a
  phase waits until it reads all of them set;
- `ring_gemv_phases_only`: no short phases, so a layer is four GEMV phases, each waiting for the
  one before;
- `deps_only` (`_flags`): the phases and their waits without the weight stream (the chain of
  dependencies alone);
- `ring_traced` (`ring_flags_traced`): `ring` with timestamps (%globaltimer) where each phase's
  wait ended and its work ended, and where the producer reached each GEMV phase's first and
  last chunk: a mean timeline of the middle layers;
- `chain_tma`: a kernel a phase, as the engine launches them (programmatic dependent launches):
  each GEMV phase this kernel with that phase alone, its producer copying chunks before the
  dependent-launch wait (only the consumer waits), the short phases the barrier probe's kernels.
Layer forms (`--kinds`, see `layer_kind`): the engine's ten phases, or the layer with its short
phases folded into the GEMVs but attention. Each form's sums are checked against torch's, so
every byte was read once.

    python benchmarks/ring_stream_probe.py --out /tmp/out/ring_probe.json
"""
from __future__ import annotations

import argparse
import json
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
from benchmarks.layer_barrier_probe import (SHORT, STREAM, _short_kernel, _wrap32,  # noqa: E402
                                           layer_phases)
from peregrine.kernels._gluon import globaltimer as _now  # noqa: E402
from peregrine.kernels._gluon import (cta_barrier, pdl_release, pdl_wait,  # noqa: E402
                                      ring_barriers, tma_load)
from peregrine.kernels._gluon import poll_acquire as _poll  # noqa: E402

HBM_GBPS = 4200.0
COLS = gl.constexpr(32)  # int32 words in a chunk row (128 bytes)
SHORT_BLOCK = 2048  # words a consumer step of a short phase reads
FLAG_SLOTS = gl.constexpr(256)  # a phase's counter, or its programs' flags (at most 256)


def layer_kind(kind: str, bits: int) -> list[tuple[str, int, int, int]]:
    """One layer's phases: `engine`, the engine's ten; `fused`, the RMSNorms, RoPE/store, the
    attention merge and SiLU-and-mul folded into the GEMV phases around them (the qkv, gate/up
    and down phases, the merge into o), so a layer is qkv, attention, o, gate/up, down;
    `fused_wide`, the same with attention's reads spread over 128 programs instead of 32."""
    phases = layer_phases(bits)
    if kind == "engine":
        return phases
    folded = {"norm", "rope_store", "attn_merge", "silu_mul"}
    out = [p for p in phases if p[0] not in folded]
    if kind == "fused_wide":
        out = [("attn_split", SHORT, p[2] * p[3] // 128, 128) if p[0] == "attn_split" else p
               for p in out]
    return out


@gluon.jit
def _flags_set(ptr, n, idx):
    """1 when the first n per-program flags at ptr are set (each read with acquire), else 0."""
    on = (idx < n).to(gl.int32)
    v = gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.u32 $0, 1; "
        "@p ld.acquire.gpu.global.b32 $0, [$1]; }", "=r,l,r", [ptr + idx, on], dtype=gl.int32,
        is_pure=False, pack=1)
    return gl.min(v, 0)


@gluon.jit
def _set_flag(ptr):
    gl.inline_asm_elementwise("st.release.gpu.global.b32 [$1], 1; mov.u32 $0, 0;", "=r,l",
                              [ptr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _producer(desc, bufs, ready, empty, sched_ptr, n_stream, ptrace_ptr, P, R: gl.constexpr,
              S: gl.constexpr, TRACE: gl.constexpr):
    """Every stream phase's chunks of this program, in order, each into the next free slot (with
    TRACE, the time each stream phase's first and last chunks got their slots)."""
    pid = gl.program_id(0)
    i = 0
    for f in range(n_stream):
        base = gl.load(sched_ptr + 2 * f)
        nch = gl.load(sched_ptr + 2 * f + 1)
        row0 = base + pid * nch * R
        for c in range(nch):
            slot = i % S
            mbarrier.wait(empty.index(slot), ((i // S) & 1) ^ 1)
            if TRACE:
                if c == 0:
                    gl.store(ptrace_ptr + (f * P + pid) * 2, _now())
                if c == nch - 1:
                    gl.store(ptrace_ptr + (f * P + pid) * 2 + 1, _now())
            mbarrier.expect(ready.index(slot), R * COLS * 4)
            tma_load(desc, [row0 + c * R, 0], ready.index(slot), bufs.index(slot))
            i += 1


@gluon.jit
def _consumer(bufs, ready, empty, table_ptr, n_phases, a_ptr, out_ptr, cnt_ptr, ctrace_ptr, P,
              R: gl.constexpr, S: gl.constexpr, WAIT: gl.constexpr, BLOCK: gl.constexpr,
              FLAGS: gl.constexpr, TRACE: gl.constexpr, PDL: gl.constexpr):
    """Each phase after its dependency: a stream phase sums its chunks as they land, a short
    phase's first `programs` programs read their words; then the program says it is done: a
    release add on the phase's counter, or with FLAGS a release store of its own flag, which
    the next phase reads all of (with TRACE, the times the phase's dependency was met and its
    work ended)."""
    pid = gl.program_id(0)
    L2: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    L1: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    LF: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
    offs = gl.arange(0, BLOCK, layout=L1)
    idx = gl.arange(0, FLAG_SLOTS, layout=LF)
    pdl_wait(PDL)  # (launched as a dependent: the producer's first chunks are already on the way)
    i = 0
    for f in range(n_phases):
        kind = gl.load(table_ptr + 4 * f)
        words = gl.load(table_ptr + 4 * f + 1)
        nprog = gl.load(table_ptr + 4 * f + 2)
        need = gl.load(table_ptr + 4 * f + 3)
        if (kind == 0) | (pid < nprog):
            if WAIT:
                if f > 0:
                    prev = cnt_ptr + (f - 1) * FLAG_SLOTS
                    if FLAGS:
                        done = _flags_set(prev, need, idx)
                        while done == 0:
                            done = _flags_set(prev, need, idx)
                    else:
                        seen = _poll(prev)
                        while seen < need:
                            seen = _poll(prev)
            if TRACE:
                gl.store(ctrace_ptr + (f * P + pid) * 2, _now())
            if kind == 0:
                acc = gl.zeros([R, COLS], gl.int32, L2)
                for c in range(words):
                    slot = i % S
                    mbarrier.wait(ready.index(slot), (i // S) & 1)
                    acc += bufs.index(slot).load(L2)
                    cta_barrier()
                    fence_async_shared()
                    mbarrier.arrive(empty.index(slot), count=1)
                    i += 1
                total = gl.sum(gl.sum(acc, 1), 0)
            else:
                acc1 = gl.zeros([BLOCK], gl.int32, L1)
                lo = pid * words
                for off in range(0, words, BLOCK):
                    acc1 += gl.load(a_ptr + lo + off + offs, mask=off + offs < words, other=0)
                total = gl.sum(acc1, 0)
            gl.store(out_ptr + f * P + pid, total)
            if TRACE:
                gl.store(ctrace_ptr + (f * P + pid) * 2 + 1, _now())
            cta_barrier()
            if FLAGS:
                _set_flag(cnt_ptr + f * FLAG_SLOTS + pid)
            else:
                gl.atomic_add(cnt_ptr + f * FLAG_SLOTS, 1, sem="release", scope="gpu")
    pdl_release(PDL)


@gluon.jit
def _ring_kernel(desc, sched_ptr, n_stream, table_ptr, n_phases, a_ptr, out_ptr, cnt_ptr,
                 ctrace_ptr, ptrace_ptr, P, R: gl.constexpr, S: gl.constexpr,
                 WAIT: gl.constexpr, BLOCK: gl.constexpr, FLAGS: gl.constexpr,
                 TRACE: gl.constexpr, PDL: gl.constexpr = False):
    bufs = gl.allocate_shared_memory(gl.int32, [S, R, COLS], desc.layout)
    ready, empty = ring_barriers(S)
    gl.warp_specialize([
        (_consumer, (bufs, ready, empty, table_ptr, n_phases, a_ptr, out_ptr, cnt_ptr, ctrace_ptr,
                     P, R, S, WAIT, BLOCK, FLAGS, TRACE, PDL)),
        (_producer, (desc, bufs, ready, empty, sched_ptr, n_stream, ptrace_ptr, P, R, S, TRACE)),
    ], [1], [48])


def _tables(phases, P: int, rows: int, short: bool, stream: bool):
    """(table, sched, rows of weights): the consumer's phases (kind, chunks or words, programs,
    programs of the phase before) and the producer's stream phases (first row, chunks)."""
    chunk_words = rows * COLS.value
    table, sched, base, prev_n = [], [], 0, 0
    for _, kind, words, nprog in phases:
        if kind == STREAM:
            nch = -(-words // (P * chunk_words))
            sched.append([base, nch if stream else 0])
            table.append([STREAM, nch if stream else 0, P, prev_n])
            base += P * nch * rows
            prev_n = P
        elif short:
            table.append([SHORT, words, nprog, prev_n])
            prev_n = nprog
    return table, sched, base


# name: (dependencies waited for, per-program flags, short phases, weight stream, timestamps,
# a kernel a phase)
FORMS = {
    "ring_free": (False, False, True, True, False, False),
    "ring": (True, False, True, True, False, False),
    "ring_flags": (True, True, True, True, False, False),
    "ring_gemv_phases_only": (True, False, False, True, False, False),
    "deps_only": (True, False, True, False, False, False),
    "deps_only_flags": (True, True, True, False, False, False),
    "ring_traced": (True, False, True, True, True, False),
    "ring_flags_traced": (True, True, True, True, True, False),
    "chain_tma": (False, False, True, True, False, True),
}


def _timeline(ctrace: torch.Tensor, ptrace: torch.Tensor, table, sched, layers: int) -> dict:
    """Per phase of a layer (mean over the middle layers): when its dependency was met (the
    first and the last program) and when its work ended (the last program), and when the producer
    reached each stream phase's first and last chunks, in us from the layer's first phase."""
    per = len(table) // layers
    nst = len(sched) // layers
    out = {"phases": [], "producer": []}
    mid = range(layers // 4, layers - layers // 4)
    ct = ctrace.double() / 1e3
    pt = ptrace.double() / 1e3
    for j in range(per):
        met_first, met_last, end_last = [], [], []
        for layer in mid:
            f = layer * per + j
            t0 = ct[layer * per, :table[layer * per][2], 0].min()
            n = table[f][2]
            met_first.append(float(ct[f, :n, 0].min() - t0))
            met_last.append(float(ct[f, :n, 0].max() - t0))
            end_last.append(float(ct[f, :n, 1].max() - t0))
        out["phases"].append({"kind": "stream" if table[j][0] == STREAM else "short",
                              "met_first": round(sum(met_first) / len(mid), 2),
                              "met_last": round(sum(met_last) / len(mid), 2),
                              "end_last": round(sum(end_last) / len(mid), 2)})
    for j in range(nst):
        first, last = [], []
        for layer in mid:
            t0 = ct[layer * per, :table[layer * per][2], 0].min()
            g = layer * nst + j
            first.append(float(pt[g, :, 0].mean() - t0))
            last.append(float(pt[g, :, 1].mean() - t0))
        out["producer"].append({"first_chunk": round(sum(first) / len(mid), 2),
                                "last_chunk": round(sum(last) / len(mid), 2)})
    return out


def run(bits: int, kind: str, layers: int, rows: int, stages: int, iters: int, forms: list[str],
        dev: torch.device) -> dict:
    P = torch.cuda.get_device_properties(dev).multi_processor_count
    assert P <= FLAG_SLOTS.value
    chunk_words = rows * COLS.value
    phases = layer_kind(kind, bits) * layers
    full, full_sched, base = _tables(phases, P, rows, True, True)
    stream_words = base * COLS.value
    w = torch.randint(-2**31, 2**31 - 1, (base, COLS.value), dtype=torch.int32, device=dev)
    short_words = max(wd * n for _, k, wd, n in phases if k == SHORT)
    a = torch.randint(-2**31, 2**31 - 1, (short_words,), dtype=torch.int32, device=dev)
    out = torch.zeros(len(full), P, dtype=torch.int32, device=dev)
    cnt = torch.zeros(len(full), FLAG_SLOTS.value, dtype=torch.int32, device=dev)
    ctrace = torch.zeros(len(full), P, 2, dtype=torch.int64, device=dev)
    ptrace = torch.zeros(len(full_sched), P, 2, dtype=torch.int64, device=dev)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [rows, COLS.value], layout)
    want = [_wrap32(w[b_:b_ + P * nch * rows]) for b_, nch in full_sched]
    result = {"bits": bits, "layer": kind, "layers": layers, "programs": P,
              "chunk_bytes": chunk_words * 4, "stages": stages,
              "ring_bytes": stages * chunk_words * 4,
              "weight_bytes_per_layer": stream_words * 4 // layers,
              "wall_us_per_layer": stream_words * 4 / layers / (HBM_GBPS * 1e3)}
    t0 = time.time()
    for name in forms:
        wait, flags, short, stream, trace, chain = FORMS[name]
        table, sched, _ = _tables(phases, P, rows, short, stream)
        table_t = torch.tensor(table, dtype=torch.int32, device=dev)
        sched_t = torch.tensor(sched, dtype=torch.int32, device=dev)
        # a kernel a phase: each GEMV phase's own one-row table, and its row of the schedule
        one = {f: (torch.tensor([[STREAM, r[1], P, 0]], dtype=torch.int32, device=dev),
                   sum(1 for q in table[:f] if q[0] == STREAM))
               for f, r in enumerate(table) if chain and r[0] == STREAM}

        def call():
            if not chain:
                cnt.zero_()
                _ring_kernel[(P,)](desc, sched_t, len(sched), table_t, len(table), a, out, cnt,
                                   ctrace, ptrace, P, R=rows, S=stages, WAIT=wait,
                                   BLOCK=SHORT_BLOCK, FLAGS=flags, TRACE=trace, num_warps=4,
                                   maxnreg=128)
                return
            for f, r in enumerate(table):
                if r[0] == STREAM:
                    row, g = one[f]
                    _ring_kernel[(P,)](desc, sched_t[g:], 1, row, 1, a, out[f], cnt[f], ctrace,
                                       ptrace, P, R=rows, S=stages, WAIT=False,
                                       BLOCK=SHORT_BLOCK, FLAGS=False, TRACE=False, PDL=True,
                                       num_warps=4, maxnreg=128, launch_pdl=True)
                else:
                    _short_kernel[(r[2],)](a, out[f], 0, r[1], BLOCK=SHORT_BLOCK, PDL=True,
                                           num_warps=4, launch_pdl=True)

        out.zero_()
        call()
        torch.cuda.synchronize()
        if stream:
            got = [_wrap32(out[i]) for i, r in enumerate(table) if r[0] == STREAM]
            assert got == want, f"{name}: the streamed words' sums differ"
        if trace:
            result[f"{name}_timeline"] = _timeline(ctrace.cpu(), ptrace.cpu(), table, sched,
                                                   layers)
            print(json.dumps(result[f"{name}_timeline"]), flush=True)
        ms = graph_replay_ms([call], iters)
        result[f"{name}_us_per_layer"] = round(ms * 1e3 / layers, 2)
        print(f"{bits}-bit {kind}, chunks {chunk_words * 4 // 1024} KB x {stages}: {name:22s} "
              f"{ms * 1e3 / layers:7.2f} us a layer (wall {result['wall_us_per_layer']:.2f})"
              f"  ({time.time() - t0:.0f} s)", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--bits", default="4,8")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rings", default="64x24,128x12,128x8,64x12",
                   help="chunk rows (128 bytes each) x stages, comma-separated")
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--kinds", default="engine,fused,fused_wide", help="layer forms: engine, fused, "
                   "fused_wide (see layer_kind)")
    p.add_argument("--iters", type=int, default=20)
    ns = p.parse_args()
    dev = torch.device("cuda")
    results = []
    for b in ns.bits.split(","):
        for kind in ns.kinds.split(","):
            for ring in ns.rings.split(","):
                r, s = (int(x) for x in ring.split("x"))
                results.append(run(int(b), kind, ns.layers, r, s, ns.iters, ns.forms.split(","),
                                   dev))
    write_results(ns.out, dev, results)


if __name__ == "__main__":
    main()
