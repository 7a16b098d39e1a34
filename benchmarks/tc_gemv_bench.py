"""The one-row 4-bit GEMV on tensor cores (kernels/wna16_gemv_tc.py) against the packed-half
default, per Llama-3-8B projection: µs per call (CUDA-graph replays over enough weight copies
that nothing is served from L2), the error against the exact product in output ulps, and a grid
of launch configs (tile width V, warps per program, K split).

    python benchmarks/tc_gemv_bench.py --out /tmp/out/tc.json [--grid] [--iters 20]

The down projection is also timed gated (its input silu(gate) * up computed inside) and as the
activation kernel followed by the ungated GEMV.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_replay_ms  # noqa: E402
from benchmarks.gemv_bench import L2_FLUSH_BYTES, SHAPES, _clone_layout, _nbytes, _wna16  # noqa: E402


def _err_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    eps = torch.finfo(got.dtype).eps
    unit = torch.maximum(want.abs(), want.pow(2).mean().sqrt()) * eps
    return ((got.float() - want).abs() / unit).max().item()


def main() -> None:
    from peregrine.kernels.activation import silu_and_mul
    from peregrine.kernels.gemv import GemvConfig
    import peregrine.kernels.wna16_gemv as gemv_module
    from peregrine.kernels.wna16_gemv import tc_config, wna16_gemv
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--grid", action="store_true", help="time every launch config too")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--grid-v", default="1,2,4", help="tile widths V the grid takes")
    p.add_argument("--grid-warps", default="1,2,4,8", help="warps per program the grid takes")
    p.add_argument("--rows", default="",
                   help="more row counts (2-8) to time tc against the default variant at")
    p.add_argument("--bits", type=int, default=4, help="4 or 6")
    p.add_argument("--aheads", default="4:4",
                   help="(weights, inputs) steps ahead the grid takes, as W:X pairs (2, 4, 6, 8)")
    p.add_argument("--shapes", default="", help="projections to time (default: all four)")
    p.add_argument("--grid-splits", default="pow2",
                   help="K splits the grid takes: pow2 (1-32), divisors (every divisor of the "
                        "groups), or a list")
    ns = p.parse_args()
    dev = torch.device("cuda")
    rows: list[dict] = []
    layer = {"half2_prefetch": 0.0, "tc": 0.0}
    for proj, (k, n) in SHAPES["8b"].items():
        if ns.shapes and proj not in ns.shapes.split(","):
            continue
        w = _wna16(k, n, ns.bits, True, dev)
        copies = max(2, min(64, -(-L2_FLUSH_BYTES // _nbytes(*w.tensors().values()))))
        ws = [w] + [_clone_layout(w) for _ in range(copies - 1)]
        gated = proj == "down"
        if gated:
            h = torch.randn(1, 2 * k, device=dev, dtype=torch.bfloat16) * 3
            x = silu_and_mul(h)
        else:
            x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        want = x.float() @ w.dequantize(torch.float32).t()

        def run(tag: str, fn, check=None) -> float | None:
            try:
                us = graph_replay_ms([lambda w_=w_: fn(w_) for w_ in ws], ns.iters) * 1e3 / len(ws)
                err = _err_ulps(check(w) if check else fn(w), want)
            except Exception as e:  # a config that does not run: say so, go on
                torch.cuda.synchronize()
                rows.append(dict(proj=proj, K=k, N=n, method=tag, error=f"{type(e).__name__}: "
                                 f"{str(e)[:300]}"))
                print(f"{proj:8s} {tag:34s} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
                return None
            rows.append(dict(proj=proj, K=k, N=n, method=tag, us=us, err_ulps=err))
            print(f"{proj:8s} {tag:34s} {us:8.2f} us  err {err:.2f} ulp", flush=True)
            return us

        for variant in ("half2_prefetch", "tc"):
            us = run(variant, lambda w_, v=variant: wna16_gemv(x, w_, variant=v))
            if gated:
                us_g = run(f"{variant} gated", lambda w_, v=variant: wna16_gemv(
                    h, w_, variant=v, gated=True))
                if us_g is not None:
                    us = us_g
                run(f"silu_and_mul + {variant}", lambda w_, v=variant: wna16_gemv(
                    silu_and_mul(h), w_, variant=v))
            if us is not None:
                layer[variant] += us
        for m in (int(r) for r in ns.rows.split(",") if r):
            xm = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            want_m = xm.float() @ w.dequantize(torch.float32).t()
            for variant in (None, "tc"):
                tag = f"{variant or 'default'} rows {m}"
                try:
                    us = graph_replay_ms([lambda w_=w_: wna16_gemv(xm, w_, variant=variant)
                                          for w_ in ws], ns.iters) * 1e3 / len(ws)
                    err = _err_ulps(wna16_gemv(xm, w, variant=variant), want_m)
                except Exception as e:  # a variant that does not run here: say so, go on
                    torch.cuda.synchronize()
                    print(f"{proj:8s} {tag:34s} ERROR {type(e).__name__}: {str(e)[:300]}",
                          flush=True)
                    continue
                rows.append(dict(proj=proj, K=k, N=n, M=m, method=tag, us=us, err_ulps=err))
                print(f"{proj:8s} {tag:34s} {us:8.2f} us  err {err:.2f} ulp", flush=True)
        cfg = tc_config(w, dev)
        rows.append(dict(proj=proj, method="tc default config", V=cfg.block_n // 16 //
                         cfg.num_warps, warps=cfg.num_warps, split=cfg.split_k))
        print(f"{proj:8s} tc default: V {cfg.block_n // 16 // cfg.num_warps} warps "
              f"{cfg.num_warps} split {cfg.split_k}", flush=True)
        if ns.grid:
            defaults = gemv_module._TC_AHEAD, gemv_module._TC_X_AHEAD
            chunks = k // 128
            best = None
            for ahead in ns.aheads.split(","):
                gemv_module._TC_AHEAD, gemv_module._TC_X_AHEAD = map(int, ahead.split(":"))
                for v in (int(a) for a in ns.grid_v.split(",")):
                    for warps in (int(a) for a in ns.grid_warps.split(",")):
                        tiles = -(-n // (16 * v * warps))
                        if ns.grid_splits == "pow2":
                            splits = (1, 2, 4, 8, 16, 32)
                        elif ns.grid_splits == "divisors":
                            splits = [d for d in range(1, chunks + 1) if chunks % d == 0]
                        else:
                            splits = [int(a) for a in ns.grid_splits.split(",")]
                        for split in splits:
                            if chunks % split or not 256 <= tiles * warps * split <= 8192:
                                continue
                            c = GemvConfig(16 * v * warps, 128, split, chunks // split, warps)
                            us = run(f"tc V{v} w{warps} s{split} a{ahead}",
                                     lambda w_, c=c: wna16_gemv(x, w_, c, variant="tc"))
                            if us is not None and (best is None or us < best[0]):
                                best = (us, v, warps, split, ahead)
            gemv_module._TC_AHEAD, gemv_module._TC_X_AHEAD = defaults
            if best:
                print(f"{proj:8s} best tc: {best[0]:.2f} us at V {best[1]} warps {best[2]} "
                      f"split {best[3]} ahead {best[4]}", flush=True)
                rows.append(dict(proj=proj, method="tc best", us=best[0], V=best[1],
                                 warps=best[2], split=best[3], ahead=best[4]))
        del ws, w
        torch.cuda.empty_cache()
    print("one layer (down gated where it runs):",
          {k_: round(v_, 2) for k_, v_ in layer.items()}, flush=True)
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    json.dump({"rows": rows, "layer_us": layer}, open(ns.out, "w"), indent=1)


if __name__ == "__main__":
    main()
