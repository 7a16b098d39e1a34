"""The FP8 tensor-core GEMV (kernels/w8_gemv_tc.py) against the FP8 method's path for the same
rows without it (the 8-bit GEMV up to its cut-off, per-token FP8 activations and
torch._scaled_mm above) and with it (the method's dispatch as configured),
per Llama-3-8B projection and row count: µs per call (CUDA-graph replays over enough weight
copies that nothing is served from L2) and the error against the exact x @ (W * scale)^T in
output ulps (the _scaled_mm path rounds x to FP8, so its error is larger by design); --grid
times launch configs (tile width V, warps, K split, loads ahead) at the --grid-rows row counts;
--block takes 128 x 128 block-scaled weights through Fp8BlockMethod instead, --int8 int8 weights
through the INT8 W8A8 method.

    python benchmarks/fp8_tc_bench.py --out /tmp/out/fp8_tc.json [--rows 1,2,4,8] [--grid]
        [--grid-rows 1,8]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_replay_ms  # noqa: E402
from benchmarks.gemv_bench import L2_FLUSH_BYTES, SHAPES  # noqa: E402


BLOCK = (128, 128)


def _err_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    eps = torch.finfo(got.dtype).eps
    unit = torch.maximum(want.abs(), want.pow(2).mean().sqrt()) * eps
    return ((got.float() - want).abs() / unit).max().item()


def main() -> None:
    import peregrine.kernels.w8_gemv_tc as tc
    from peregrine.kernels.fp8_quant import FP8_DTYPE, block_dequantize
    from peregrine.kernels.gemv import GemvConfig
    from peregrine.layers.quantization import fp8
    from peregrine.layers.quantization.fp8 import apply_fp8_linear
    from peregrine.layers.quantization.int8 import apply_int8_linear
    from peregrine.testing import fp8_pack
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--grid", action="store_true", help="also time launch configs")
    p.add_argument("--grid-rows", default="1", help="the row counts the grid runs at")
    p.add_argument("--block", action="store_true",
                   help="128 x 128 block-scaled weights (Fp8BlockMethod's paths) instead")
    p.add_argument("--int8", action="store_true",
                   help="int8 weights per channel (the INT8 W8A8 method's paths) instead")
    ns = p.parse_args()
    dev = torch.device("cuda")
    block = BLOCK if ns.block else None
    block_method = fp8.Fp8BlockMethod(BLOCK)
    tc_max0 = fp8.TC_GEMV_MAX_M
    out: list[dict] = []
    layer: dict[str, float] = {}
    for proj, (k, n) in SHAPES["8b"].items():
        w = torch.randn(n, k, device=dev) * 0.02
        if ns.block:
            wq, ws = fp8_pack.quantize_blocks(w, BLOCK)
            deq = block_dequantize(wq, ws, BLOCK)
        else:
            wq, ws = fp8_pack.quantize_per_channel(w, torch.int8 if ns.int8 else FP8_DTYPE)
            deq = wq.float() * ws.float()
        del w
        copies = max(2, min(64, -(-L2_FLUSH_BYTES // wq.numel())))
        weights = [(wq, ws)] + [(wq.clone(), ws.clone()) for _ in range(copies - 1)]

        def run(tag: str, m: int, fn, want) -> float | None:
            try:
                us = graph_replay_ms([lambda w_=w_: fn(*w_) for w_ in weights],
                                     ns.iters) * 1e3 / len(weights)
                err = _err_ulps(fn(wq, ws), want)
            except Exception as e:  # a config that does not run: say so, go on
                torch.cuda.synchronize()
                print(f"{proj:8s} M={m} {tag:28s} ERROR {type(e).__name__}: {str(e)[:300]}",
                      flush=True)
                out.append(dict(proj=proj, M=m, method=tag, error=str(e)[:300]))
                return None
            out.append(dict(proj=proj, K=k, N=n, M=m, method=tag, us=us, err_ulps=err))
            print(f"{proj:8s} M={m} {tag:28s} {us:8.2f} us  err {err:.2f} ulp", flush=True)
            return us

        for m in (int(r) for r in ns.rows.split(",") if r):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            want = x.float() @ deq.t()

            def method(w_, s_, x=x):
                if ns.block:
                    return block_method.apply(SimpleNamespace(weight=w_, weight_scale_inv=s_), x)
                if ns.int8:
                    return apply_int8_linear(x, w_, s_.reshape(1, n), None, None)
                return apply_fp8_linear(x, w_, s_.reshape(1, n), None, None)

            for tag, tc_max in (("GEMV / _scaled_mm", 0), ("method", fp8.TC_GEMV_MAX_M)):
                fp8.TC_GEMV_MAX_M = tc_max
                us = run(tag, m, method, want)
                if us is not None:
                    layer[f"{tag} M={m}"] = layer.get(f"{tag} M={m}", 0.0) + us
            fp8.TC_GEMV_MAX_M = tc_max0
            us = run("tc", m, lambda w_, s_: tc.w8_gemv_tc(x, w_, s_, block=block), want)
            if us is not None:
                layer[f"tc M={m}"] = layer.get(f"tc M={m}", 0.0) + us
        cfg = tc.fp8_tc_config(n, k, dev)
        print(f"{proj:8s} tc default: block_n {cfg.block_n} warps {cfg.num_warps} split "
              f"{cfg.split_k}", flush=True)
        for m in (int(r) for r in ns.grid_rows.split(",")
                  if r and ns.grid and not (ns.block or ns.int8)):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            want = x.float() @ deq.t()
            chunks = k // tc.CHUNK
            ahead0 = tc._AHEAD
            for ahead in (2, 4):
                tc._AHEAD = ahead
                for v in (1, 2, 4):
                    for warps in (1, 2, 4):
                        tiles = -(-n // (16 * v * warps))
                        for split in (1, 2, 4, 7, 8, 14, 16, 28, 32):
                            if chunks % split or not 256 <= tiles * warps * split <= 8192:
                                continue
                            c = GemvConfig(16 * v * warps, tc.STEP, split, chunks // split * 4,
                                           warps)
                            run(f"tc V{v} w{warps} s{split} a{ahead}", m,
                                lambda w_, s_, c=c, x=x: tc.w8_gemv_tc(x, w_, s_, c), want)
            tc._AHEAD = ahead0
        del weights, deq
        torch.cuda.empty_cache()
    best: dict[tuple[str, int], list[dict]] = {}
    for r in out:
        if r["method"].startswith("tc ") and "us" in r:
            best.setdefault((r["proj"], r["M"]), []).append(r)
    for (proj, m), rs in sorted(best.items()):
        top = sorted(rs, key=lambda r: r["us"])[:4]
        print(f"best {proj:8s} M={m}: " + ", ".join(f"{r['method'][3:]} {r['us']:.2f}"
                                                   for r in top), flush=True)
    print("one layer:", {k_: round(v_, 2) for k_, v_ in layer.items()}, flush=True)
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    json.dump({"rows": out, "layer_us": layer}, open(ns.out, "w"), indent=1)


if __name__ == "__main__":
    main()
