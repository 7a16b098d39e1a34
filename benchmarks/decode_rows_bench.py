"""Checks and times the row-tile persistent decode kernel (kernels/decode_rows.py) on
Llama-3-8B's layers at batch 1 with random 4-bit weights, beside the other persistent form
(kernels/decode_layers.py) in the same process.

Checks (decode_layer_ring.reference_layers: the layers in torch with the kernels' rounding
points): one and two layers at several context lengths (the first token, a context within one
attention block a program, one longer than all of them together), and that repeated calls give
the same bits; over the timed model's 32 layers the largest relative RMS difference is recorded
beside the other kernel's on the same layers (both drift past the few-layer bound there).
Times are CUDA-graph replays of 32 layers, per placement (programs an SM x ring stages), group
sums made once or not, and loader form (`dataflow`: a chunk's groups; `phase`: the whole phase
before; `free`: no waits, a floor whose outputs are not the layers'; `nochunk`: no waits and
no MMAs, the weight stream and the finishes alone; `nostream`: no waits and no weight stream,
the consumer warps alone; `skeleton`: no waits, no stream and no MMAs, the consumer warps' work
outside the chunks' steps).

    python benchmarks/decode_rows_bench.py --out /tmp/out/decode_rows.json

`--ncu`: one launch of each wait and input form of the first placement, for Nsight Compute:

    ncu --clock-control none --profile-from-start off -k regex:decode_rows_kernel \
        --section WarpStateStats --section SourceCounters -o /tmp/out/rows \
        python benchmarks/decode_rows_bench.py --ncu --out - --layers 8 --waits free --pre 0
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_replay_ms, write_results  # noqa: E402
from benchmarks.decode_layer_ring import (LAYERS, ONE_LAYER, build, call, compare,  # noqa: E402
                                          mismatches, reference_layers, state)


def check(layers: int, ctx: int, P: int, dev: torch.device, splits: int) -> dict:
    """The kernel's outputs against the reference, and whether 5 more calls give its bits."""
    d = build(layers, P, ctx, dev, rows=True, splits=splits)
    want = reference_layers(d)
    call(d)
    torch.cuda.synchronize()
    got = {k: v.clone() for k, v in state(d).items()}
    bounds = ONE_LAYER if layers == 1 else LAYERS
    bad = mismatches(got, want, *bounds)
    same = True
    for _ in range(5):
        call(d)
        torch.cuda.synchronize()
        same &= all(torch.equal(v, got[k]) for k, v in state(d).items())
    rec = {"layers": layers, "ctx": ctx, "programs": P, "errors": compare(got, want),
           "outside_bounds": sorted(bad), "same_bits": bool(same)}
    del d
    torch.cuda.empty_cache()
    return rec


def profile_once(ns, dev: torch.device, sms: int) -> None:
    """--ncu: each wait and input form of the first placement launched once (after a warm-up
    call) between cudaProfilerStart and cudaProfilerStop."""
    d = build(ns.layers, 2 * sms, ns.ctx, dev, rows=True, splits=ns.splits)
    dl = d["dl"]
    per_sm, stages = (int(v) for v in ns.placements.split(",")[0].split("x"))
    dl.stages = stages
    dl.place(per_sm * sms)
    for wait, pre in [(w, int(r)) for w in ns.waits.split(",") for r in ns.pre.split(",")]:
        dl.wait, dl.pre = wait, bool(pre)
        call(d)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        call(d)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print("profiled", f"{per_sm}x{stages}:{wait}:pre{pre}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--checks", default="1x1,1x256,2x37,2x777",
                   help="layers x context lengths checked first, comma-separated")
    p.add_argument("--placements", default="2x4,1x8", help="programs an SM x ring stages")
    p.add_argument("--waits", default="dataflow,free,phase,nochunk,nostream,skeleton")
    p.add_argument("--pre", default="1,0",
                   help="the inputs' group sums made once (1) or not (0)")
    p.add_argument("--splits", type=int, default=16)
    p.add_argument("--baseline", default="2x8,1x16",
                   help="decode_layers placements timed beside it (empty: none)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ncu", action="store_true",
                   help="one launch of the first placement in each wait and input form between "
                        "cudaProfilerStart/Stop, for a profiler (no checks, no timings)")
    ns = p.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if ns.ncu:
        profile_once(ns, dev, sms)
        return
    t0 = time.time()
    results: list = []
    fails = 0
    for spec in ns.checks.split(","):
        if not spec:
            continue
        n, ctx = (int(v) for v in spec.split("x"))
        rec = check(n, ctx, 2 * sms, dev, ns.splits)
        fails += bool(rec["outside_bounds"]) or not rec["same_bits"]
        results.append(rec)
        print(json.dumps(rec), f"({time.time() - t0:.0f} s)", flush=True)
    d = build(ns.layers, 2 * sms, ns.ctx, dev, rows=True, splits=ns.splits)
    want = reference_layers(d)
    dl = d["dl"]
    timed = {"layers": ns.layers, "ctx": ns.ctx, "gpu": torch.cuda.get_device_name(dev),
             "weight_bytes_per_layer": dl.weight_bytes / ns.layers,
             "wall_us_per_layer": round(dl.weight_bytes / ns.layers / 4.2e6, 2), "rows": {}}
    for pl in ns.placements.split(","):
        per_sm, stages = (int(v) for v in pl.split("x"))
        dl.stages = stages
        dl.place(per_sm * sms)
        for wait, pre in [(w, int(r)) for w in ns.waits.split(",") for r in ns.pre.split(",")]:
            dl.wait, dl.pre = wait, bool(pre)
            key = f"{pl}:{wait}:pre{pre}"
            try:
                call(d)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - e.g. not resident at once: record, go on
                timed["rows"][key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(key, timed["rows"][key], flush=True)
                continue
            rec = {}
            ms = graph_replay_ms([lambda: call(d)], ns.iters)
            rec["us_per_layer"] = round(ms * 1e3 / ns.layers, 2)
            if ns.layers == 32:  # the LM head at the wall and the step's other kernels
                rec["est_tok_s"] = round(1e6 / (ms * 1e3 + 250 + 30), 1)
            if wait in ("dataflow", "phase"):  # (32 layers drift past LAYERS' bound in both
                # kernels: the largest relative RMS is recorded beside the other kernel's)
                call(d)
                torch.cuda.synchronize()
                rec["rel_rms"] = max(e["rel_rms"] for e in compare(state(d), want).values())
            timed["rows"][key] = rec
            print(key, json.dumps(rec), f"({time.time() - t0:.0f} s)", flush=True)
    results.append(timed)
    del d, dl
    torch.cuda.empty_cache()
    if ns.baseline:
        d = build(ns.layers, 2 * sms, ns.ctx, dev, splits=ns.splits)
        base = {"decode_layers": {}}
        for pl in ns.baseline.split(","):
            per_sm, stages = (int(v) for v in pl.split("x"))
            d["dl"].stages = stages
            d["dl"].place(per_sm * sms)
            ms = graph_replay_ms([lambda: call(d)], ns.iters)
            call(d)
            torch.cuda.synchronize()
            # (the same layers, seed and inputs: the same reference)
            rel = max(e["rel_rms"] for e in compare(state(d), want).values())
            base["decode_layers"][pl] = {"us_per_layer": round(ms * 1e3 / ns.layers, 2),
                                         "rel_rms": rel}
            print("decode_layers", pl, base["decode_layers"][pl], flush=True)
        results.append(base)
    write_results(ns.out, dev, results)
    if fails:
        sys.exit(f"decode_rows_bench: {fails} checks outside their bounds")


if __name__ == "__main__":
    main()
