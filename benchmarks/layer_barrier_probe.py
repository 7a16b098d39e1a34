"""What do a decode step's kernel boundaries cost at batch 1, and what would one persistent kernel
with grid-wide barriers between the same phases save? Stand-ins only: every GEMV is a phase that
streams its weight bytes (int32 words folded into a sum), every short kernel (RMSNorm, RoPE and
the K/V store, attention's split and merge, SiLU-and-mul) a phase of a few programs that read a
few KB; 32 Llama-3-8B layers of them in order, each layer's weights its own (no L2 reuse).

Forms, each timed as a CUDA-graph replay of the whole stack:
- `chain`: one kernel a phase, as the engine launches them: programmatic dependent launches,
  each kernel waiting before its first load, the streaming kernels releasing the next one after
  their loads, the short ones at their start (`chain_plain`: plain launches);
- `persistent`: one kernel for all phases, its programs all resident, a grid-wide barrier (an
  atomic arrival count, polled with acquire loads) after every phase;
- `persistent_ahead`: the same, each program loading its first block of the next streaming
  phase before the barrier (weights depend on nothing before them);
- `stream_only`: one kernel reading every streaming phase's bytes, no boundary at all (the floor).

    python benchmarks/layer_barrier_probe.py --out /tmp/out/barrier_probe.json

The word sums are checked against torch's, so every byte was read once per form. A persistent
form's programs must all be resident at once, or its first barrier never opens: hence 1 or 2
programs an SM (4 warps each).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_replay_ms, write_results  # noqa: E402
from peregrine.kernels._utils import gdc_launch_dependents, gdc_wait  # noqa: E402

HBM_GBPS = 4200.0
BLOCK = 2048  # int32 words a program reads per step (8 KB: 4 warps x 32 lanes x 16 words)
STREAM, SHORT = 0, 1

# Llama-3-8B, one decode row: (name, kind, weight bytes per bit of weight width / programs, words)
_K, _QKV, _INTER = 4096, 6144, 14336


def layer_phases(bits: int) -> list[tuple[str, int, int, int]]:
    """(name, kind, words, programs) for one layer: a stream's words are its weight's, a short
    phase's are each program's."""
    def w(k: int, n: int) -> int:
        return k * n * bits // 32
    return [("norm", SHORT, 2048, 1), ("qkv", STREAM, w(_K, _QKV), 0),
            ("rope_store", SHORT, 512, 8), ("attn_split", SHORT, 12288, 32),
            ("attn_merge", SHORT, 256, 32), ("o", STREAM, w(_K, _K), 0),
            ("norm", SHORT, 2048, 1), ("gate_up", STREAM, w(_K, 2 * _INTER), 0),
            ("silu_mul", SHORT, 2048, 14), ("down", STREAM, w(_INTER, _K), 0)]


@triton.jit
def _fold(ptr, lo, hi, offs, acc, BLOCK: tl.constexpr):
    """acc + the words [lo, hi) of ptr, BLOCK at a time, the next block loaded before the add."""
    nxt = tl.load(ptr + lo + offs, mask=lo + offs < hi, other=0)
    for base in range(lo, hi, BLOCK):
        cur = nxt
        nb = base + BLOCK
        nxt = tl.load(ptr + nb + offs, mask=nb + offs < hi, other=0)
        acc += cur
    return acc


@triton.jit
def _stream_kernel(w_ptr, out_ptr, start, nwords, per, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if PDL:
        gdc_wait()
    lo = start + pid * per
    hi = tl.minimum(lo + per, start + nwords)
    acc = _fold(w_ptr, lo, hi, offs, tl.zeros((BLOCK,), tl.int32), BLOCK)
    if PDL:
        gdc_launch_dependents()
    tl.store(out_ptr + pid, tl.sum(acc))


@triton.jit
def _short_kernel(a_ptr, out_ptr, start, words, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    lo = start + pid * words
    acc = _fold(a_ptr, lo, lo + words, offs, tl.zeros((BLOCK,), tl.int32), BLOCK)
    tl.store(out_ptr + pid, tl.sum(acc))


@triton.jit
def _poll(ptr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _grid_barrier(bar_ptr, n):
    tl.debug_barrier()  # the program's stores are issued before its arrival
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = _poll(bar_ptr)
    while seen < n:
        seen = _poll(bar_ptr)
    tl.debug_barrier()


@triton.jit
def _persistent_kernel(w_ptr, a_ptr, out_ptr, bar_ptr, table_ptr, n_phases, P,
                       BLOCK: tl.constexpr, AHEAD: tl.constexpr):
    """Every phase of the table in order, a grid barrier after each; the table's rows are
    (kind, start, words, programs, per-program words of a stream)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    pre = tl.zeros((BLOCK,), tl.int32)
    for p in range(n_phases):
        kind = tl.load(table_ptr + p * 5)
        start = tl.load(table_ptr + p * 5 + 1)
        words = tl.load(table_ptr + p * 5 + 2)
        nprog = tl.load(table_ptr + p * 5 + 3)
        per = tl.load(table_ptr + p * 5 + 4)
        acc = tl.zeros((BLOCK,), tl.int32)
        if kind == 0:
            lo = start + pid * per
            hi = tl.minimum(lo + per, start + words)
            if AHEAD:
                acc += pre  # this program's first block, loaded before the barrier
                lo = tl.minimum(lo + BLOCK, hi)
            acc = _fold(w_ptr, lo, hi, offs, acc, BLOCK)
            tl.store(out_ptr + p * P + pid, tl.sum(acc))
        elif pid < nprog:
            lo = start + pid * words
            acc = _fold(a_ptr, lo, lo + words, offs, acc, BLOCK)
            tl.store(out_ptr + p * P + pid, tl.sum(acc))
        if AHEAD:
            q = tl.minimum(p + 1, n_phases - 1)
            nkind = tl.load(table_ptr + q * 5)
            nstart = tl.load(table_ptr + q * 5 + 1)
            nwords = tl.load(table_ptr + q * 5 + 2)
            nper = tl.load(table_ptr + q * 5 + 4)
            nlo = nstart + pid * nper
            nhi = tl.minimum(nlo + nper, nstart + nwords)
            ok = (nkind == 0) & (p + 1 < n_phases)
            pre = tl.load(w_ptr + nlo + offs, mask=ok & (nlo + offs < nhi), other=0)
        _grid_barrier(bar_ptr + p, P)


def _wrap32(x: torch.Tensor) -> int:
    v = int(x.sum(dtype=torch.int64).item()) & 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def run(bits: int, layers: int, per_sm: int, iters: int, dev: torch.device) -> dict:
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    P = sms * per_sm
    phases = layer_phases(bits) * layers
    stream_words = sum(w for _, k, w, _ in phases if k == STREAM)
    w = torch.randint(-2**31, 2**31 - 1, (stream_words + BLOCK,), dtype=torch.int32, device=dev)
    short_words = max(w_ * n for _, k, w_, n in phases if k == SHORT)
    a = torch.randint(-2**31, 2**31 - 1, (short_words + BLOCK,), dtype=torch.int32, device=dev)
    rows, start = [], 0
    for _, kind, words, nprog in phases:
        if kind == STREAM:
            per = -(-(-(-words // P)) // BLOCK) * BLOCK
            rows.append([STREAM, start, words, P, per])
            start += words
        else:
            rows.append([SHORT, 0, words, nprog, 0])
    table = torch.tensor(rows, dtype=torch.int64, device=dev)
    out = torch.zeros(len(phases), P, dtype=torch.int32, device=dev)
    bar = torch.zeros(len(phases), dtype=torch.int32, device=dev)
    pdl = {"launch_pdl": True}

    def chain(dependent: bool):
        opts = {"PDL": dependent, "num_warps": 4, **(pdl if dependent else {})}

        def call():
            for p, (kind, s, words, nprog, per) in enumerate(rows):
                if kind == STREAM:
                    _stream_kernel[(P,)](w, out[p], s, words, per, BLOCK=BLOCK, **opts)
                else:
                    _short_kernel[(nprog,)](a, out[p], s, words, BLOCK=BLOCK, **opts)
        return call

    def persistent(ahead: bool):
        def call():
            bar.zero_()
            _persistent_kernel[(P,)](w, a, out, bar, table, len(rows), P, BLOCK=BLOCK,
                                     AHEAD=ahead, num_warps=4)
        return call

    def stream_only():
        per = -(-(-(-stream_words // P)) // BLOCK) * BLOCK
        _stream_kernel[(P,)](w, out[0], 0, stream_words, per, BLOCK=BLOCK, PDL=False,
                             num_warps=4)

    t0 = time.time()
    want = [_wrap32(w[r[1]:r[1] + r[2]]) for r in rows if r[0] == STREAM]
    result = {"bits": bits, "layers": layers, "programs": P,
              "weight_bytes_per_layer": stream_words * 4 // layers,
              "wall_us_per_layer": stream_words * 4 / layers / (HBM_GBPS * 1e3)}
    for name, fn in (("chain", chain(True)), ("chain_plain", chain(False)),
                     ("persistent", persistent(False)),
                     ("persistent_ahead", persistent(True)), ("stream_only", stream_only)):
        out.zero_()
        fn()
        torch.cuda.synchronize()
        if name != "stream_only":
            got = [_wrap32(out[i]) for i, r in enumerate(rows) if r[0] == STREAM]
            assert got == want, f"{name}: the streamed words' sums differ"
        ms = graph_replay_ms([fn], iters)
        result[f"{name}_us_per_layer"] = round(ms * 1e3 / layers, 2)
        print(f"{bits}-bit weights, {P} programs, {name:17s} {ms * 1e3 / layers:7.2f} us a layer"
              f"  ({time.time() - t0:.0f} s)", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--bits", default="4,8")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--per-sm", default="1,2",
                   help="programs an SM, 1 or 2: the persistent forms need all of them resident")
    p.add_argument("--iters", type=int, default=20)
    ns = p.parse_args()
    if any(int(k) not in (1, 2) for k in ns.per_sm.split(",")):
        p.error("--per-sm takes 1 or 2: at 3 an SM on an H200 not every program of the ahead "
                "form was resident, and its barrier never opened")
    dev = torch.device("cuda")
    results = [run(int(b), ns.layers, int(k), ns.iters, dev)
               for b in ns.bits.split(",") for k in ns.per_sm.split(",")]
    write_results(ns.out, dev, results)


if __name__ == "__main__":
    main()
