"""Small-batch quantized matmuls on the GPU: per Llama-3-8B / Llama-2-70B projection and M rows,
the time and achieved GB/s of the GEMVs (kernels/wna16_gemv.py: each variant, "fma",
"fma_prefetch", the tensor-core "mma", "inplace" and "inplace_prefetch"; kernels/gemv.py) beside the weight-only int GEMM
(kernels/wna16_gemm.py), bf16 F.linear, FP8 per-token quant + torch._scaled_mm and INT8
per-token quant + torch._int_mm.

    python benchmarks/gemv_bench.py --out /tmp/out/gemv.json [--models 8b,70b] [--rows 1,2,4,8,16]
        [--sweep] [--variants fma,inplace] [--sweep-variants inplace] [--w8-forms 0,1]

GB/s counts the bytes a call must move: weight (packed) + scales + zeros + activations + output.
Each timing replays a CUDA graph that runs the call on enough copies of the weight (>= 256 MiB in
all) that nothing is served from L2. --sweep also times a grid of GEMV tile configs at M = 1 and
GEMV_MAX_ROWS and reports the best per shape (it compiles more: a few minutes).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_replay_ms  # noqa: E402

HBM_GBPS = 4200.0  # H200: ~4.8 TB/s peak, ~4.2 TB/s reachable
L2_FLUSH_BYTES = 256 << 20
SHAPES = {  # (K, N) per projection: q/k/v fused, o, gate/up fused, down
    "8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
           "down": (14336, 4096)},
    "70b": {"qkv": (8192, 10240), "o": (8192, 8192), "gate_up": (8192, 57344),
            "down": (28672, 8192)},
}


VARIANTS = ("fma", "fma_prefetch", "mma", "inplace", "inplace_prefetch", "half2", "half2_prefetch",
            "half2_prefetch2", "half2_async", "half2_staged")


def _nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _time_us(make_calls: list[Callable[[], object]], iters: int) -> float:
    """Mean µs per call over `iters` replays of one graph that makes every call once."""
    return graph_replay_ms(make_calls, iters) * 1e3 / len(make_calls)


def _copies(weight_bytes: int) -> int:
    return max(2, min(64, -(-L2_FLUSH_BYTES // max(weight_bytes, 1))))


def _wna16(k: int, n: int, bits: int, zp: bool, dev: torch.device):
    from peregrine.layers.quantization.wna16 import WNA16Layout
    q = torch.randint(0, 1 << bits, (k, n), device=dev, dtype=torch.int32)
    scales = torch.rand(k // 128, n, device=dev) * 0.01 + 0.002
    zeros = torch.randint(0, 1 << bits, (k // 128, n), device=dev).float() if zp else None
    w = WNA16Layout.build(q, scales, zeros, None, bits, torch.bfloat16)
    del q
    return w


def _clone_layout(w):
    return dataclasses.replace(w, **{f.name: getattr(w, f.name).clone()
                                     for f in dataclasses.fields(w)
                                     if isinstance(getattr(w, f.name), torch.Tensor)})


def _scaled_mm(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The FP8 W8A8 path above the GEMV cut-off: per-token quant + torch._scaled_mm."""
    from peregrine.kernels.fp8_quant import FP8_DTYPE, per_token_group_quant
    xq, xs = per_token_group_quant(x, FP8_DTYPE)
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)


def _int_mm(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The INT8 W8A8 path above the GEMV cut-off: per-token quant + padded torch._int_mm."""
    from peregrine.kernels.fp8_quant import per_token_group_quant
    xq, xs = per_token_group_quant(x, torch.int8)
    m = xq.shape[0]
    rows = max(24, -(-m // 8) * 8)
    xp = torch.nn.functional.pad(xq, (0, 0, 0, rows - m))
    return (torch._int_mm(xp, wq.t())[:m].float() * xs * ws).to(x.dtype)


def shape_rows(model: str, proj: str, k: int, n: int, rows: list[int], iters: int,
               sweep: bool, dev: torch.device = torch.device("cuda"),
               variants: tuple[str, ...] = VARIANTS,
               sweep_variants: tuple[str, ...] = VARIANTS + ("w8",),
               w8_forms: tuple[int, ...] = ()) -> list[dict]:
    from peregrine.kernels.gemv import GEMV_MAX_ROWS, block_m_for, w8_gemv
    from peregrine.kernels.wna16_gemm import wna16_gemm
    from peregrine.kernels.wna16_gemv import gemv_config, mma_supported, wna16_gemv
    from peregrine.testing import fp8_pack
    out: list[dict] = []

    def timed(method: str, m: int, calls: list[Callable[[], object]], moved: int,
              **extra) -> None:
        row = dict(model=model, proj=proj, K=k, N=n, M=m, method=method, **extra)
        try:
            us = _time_us(calls, iters)
        except Exception as e:  # a baseline that does not run at this shape: say so, go on
            torch.cuda.synchronize()
            out.append(dict(row, error=f"{type(e).__name__}: {str(e)[:200]}"))
            return
        gbps = moved / us / 1e3
        out.append(dict(row, us=us, GBps=gbps, pct_hbm=100 * gbps / HBM_GBPS))

    io = lambda m: (m * k + m * n) * 2  # noqa: E731  bf16 activations in, output out
    dense = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02  # (N, K)
    dcopies = [dense] + [dense.clone() for _ in range(_copies(_nbytes(dense)) - 1)]
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        timed("bf16 F.linear", m, [lambda d=d: torch.nn.functional.linear(x, d)
                                   for d in dcopies], _nbytes(dense) + io(m))
    del dcopies, dense
    for bits, zp in ((4, True), (8, False)):
        w = _wna16(k, n, bits, zp, dev)
        wbytes = _nbytes(*w.tensors().values())
        ws = [w] + [_clone_layout(w) for _ in range(_copies(wbytes) - 1)]
        label = f"int{bits}{'+zp' if zp else ''} g128"
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            if m <= GEMV_MAX_ROWS:  # past the dispatch cut-offs too, to re-measure them
                for variant in variants:
                    if variant.startswith("half2") and (m > 1 or w.bits != 4):
                        continue  # one row of 4-bit weights
                    if variant == "mma" and not mma_supported(w, x.dtype, dev):
                        continue
                    cfg = gemv_config(w, dev, block_m_for(m), variant)
                    timed(f"{label} GEMV {variant}", m,
                          [lambda v=v, var=variant: wna16_gemv(x, v, variant=var) for v in ws],
                          wbytes + io(m), config=cfg._asdict())
                    if sweep and m in (1, GEMV_MAX_ROWS) and variant in sweep_variants:
                        out.append(_sweep(model, proj, k, n, m, f"{label} GEMV {variant}",
                                          wbytes + io(m), iters,
                                          lambda c, var=variant: [
                                              lambda v=v: wna16_gemv(x, v, c, variant=var)
                                              for v in ws],
                                          wna16=True,
                                          wide=variant.startswith(("inplace", "half2")),
                                          streamed=variant == "half2_async"))
            timed(f"{label} GEMM", m, [lambda v=v: wna16_gemm(x, v) for v in ws],
                  wbytes + io(m))
        del ws, w
    for wdtype, label in ((torch.float8_e4m3fn, "fp8"), (torch.int8, "int8")):
        wq, sc = fp8_pack.quantize_per_channel(torch.randn(n, k, device=dev) * 0.02, wdtype)
        sc = sc.t().contiguous()  # (1, N)
        wbytes = _nbytes(wq, sc)
        pairs = [(wq, sc)] + [(wq.clone(), sc.clone()) for _ in range(_copies(wbytes) - 1)]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            if m <= GEMV_MAX_ROWS:  # past the dispatch cut-offs too, to re-measure them
                timed(f"{label} GEMV", m, [lambda p=p: w8_gemv(x, p[0], p[1]) for p in pairs],
                      wbytes + io(m))
                timed(f"{label} GEMV prefetch", m,
                      [lambda p=p: w8_gemv(x, p[0], p[1], prefetch=True) for p in pairs],
                      wbytes + io(m))
                for form in w8_forms:  # the K loop's other forms (kernels/gemv.py _row_dot)
                    timed(f"{label} GEMV form {form}", m,
                          [lambda p=p, f=form: w8_gemv(x, p[0], p[1], form=f) for p in pairs],
                          wbytes + io(m))
                if sweep and m in (1, GEMV_MAX_ROWS) and "w8" in sweep_variants:
                    out.append(_sweep(model, proj, k, n, m, f"{label} GEMV", wbytes + io(m),
                                      iters, lambda c: [lambda p=p: w8_gemv(x, p[0], p[1],
                                                                            config=c)
                                                        for p in pairs], wna16=False))
            gemm = _scaled_mm if wdtype != torch.int8 else _int_mm
            name = "fp8 quant+_scaled_mm" if wdtype != torch.int8 else "int8 quant+_int_mm"
            timed(name, m, [lambda p=p: gemm(x, p[0], p[1]) for p in pairs], wbytes + io(m))
        del pairs, wq, sc
    torch.cuda.empty_cache()
    return out


def _splits(k_blocks: int) -> list[tuple[int, int]]:
    """(split_k, k_iters) pairs with no empty split, for 1 to 32 splits."""
    seen: list[tuple[int, int]] = []
    for split in (1, 2, 4, 8, 16, 32):
        if split > k_blocks:
            break
        iters = -(-k_blocks // split)
        pair = (-(-k_blocks // iters), iters)
        if pair not in seen:
            seen.append(pair)
    return seen


def _sweep(model: str, proj: str, k: int, n: int, m: int, label: str, moved: int, iters: int,
           calls_for: Callable, wna16: bool, wide: bool = False,
           streamed: bool = False) -> dict:
    """The fastest GEMV config of a small grid (block_n, block_k, warps, K split); `wide`: the
    in-place variant's grid (up to 1,024 columns, K blocks of 32 to 128 inputs); `streamed`:
    the shared-memory-pipelined variant's (up to 256 columns, 2 to 8 blocks in flight)."""
    from peregrine.kernels.gemv import GemvConfig
    stages_grid: tuple[int, ...] = (1,)
    if streamed:
        grid_n, grid_k, stages_grid = (64, 128, 256), (128,), (2, 3, 4, 6, 8)
    elif wide:
        grid_n, grid_k = (64, 128, 256, 512, 1024), (32, 64, 128)
    elif wna16:
        grid_n, grid_k = (32, 64, 128, 256), (64, 128, 256)
    else:
        grid_n, grid_k = (16, 32, 64), (128, 256, 512, 1024, 2048)
    best: tuple[float, tuple] | None = None
    timings: list[tuple] = []
    for bn in grid_n:
        for bk in grid_k:
            for warps in ((4, 8) if not (wide or streamed) or bn >= 128 else (4,)):
                for stages in stages_grid:
                    for split, k_iters in _splits(-(-k // bk)):
                        cfg = GemvConfig(bn, bk, split, k_iters, warps, stages)
                        try:
                            us = _time_us(calls_for(cfg), iters)
                        except ValueError:  # a config this layout cannot use
                            continue
                        except Exception as e:  # out of shared memory or registers: skip it
                            torch.cuda.synchronize()
                            print(f"sweep {label} {tuple(cfg)}: {type(e).__name__}: "
                                  f"{str(e)[:120]}", file=sys.stderr)
                            continue
                        timings.append((*cfg, round(us, 2)))
                        if best is None or us < best[0]:
                            best = (us, cfg)
    assert best is not None
    gbps = moved / best[0] / 1e3
    return dict(model=model, proj=proj, K=k, N=n, M=m, method=f"{label} best of sweep",
                us=best[0], GBps=gbps, pct_hbm=100 * gbps / HBM_GBPS, config=best[1]._asdict(),
                grid=dict(fields=list(GemvConfig._fields) + ["us"], timings=timings))


LAYERS = {"8b": 32, "70b": 80}


def per_layer(results: list[dict]) -> list[dict]:
    """Per model, method and M with every projection timed: the four projections' sum (one
    decoder layer's linears) and the tokens/s bound it sets (layers x that sum per token)."""
    sums: dict[tuple, list[float]] = {}
    for r in results:
        if "us" in r and "sweep" not in r["method"]:
            sums.setdefault((r["model"], r["method"], r["M"]), []).append(r["us"])
    return [dict(model=mo, method=me, M=m, layer_us=sum(v),
                 tok_s_bound=1e6 / (LAYERS[mo] * sum(v)))
            for (mo, me, m), v in sums.items() if len(v) == len(SHAPES[mo])]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON results path")
    p.add_argument("--models", default="8b,70b")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--iters", type=int, default=20, help="graph replays per timing")
    p.add_argument("--sweep", action="store_true", help="also time a grid of GEMV configs")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="the int GEMV variants to time (kernels/wna16_gemv.py)")
    p.add_argument("--sweep-variants", default=",".join(VARIANTS + ("w8",)),
                   help="with --sweep: the int GEMV variants whose config grid is timed, and "
                        "w8 for the 8-bit GEMV's")
    p.add_argument("--w8-forms", default="",
                   help="also time the 8-bit GEMV with these K-loop forms (0, 1: kernels/gemv.py)")
    ns = p.parse_args()
    if not torch.cuda.is_available():
        print("gemv_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    from peregrine.kernels.gemv import GEMV_MAX_M, W8_GEMV_MAX_M
    rows = [int(r) for r in ns.rows.split(",")]
    models = [s.strip() for s in ns.models.split(",")]
    for name in models:
        if name not in SHAPES:
            raise SystemExit(f"--models: unknown {name!r} (known: {', '.join(SHAPES)})")
    t0 = time.time()
    results: list[dict] = []
    for model in models:
        for proj, (k, n) in SHAPES[model].items():
            results += shape_rows(model, proj, k, n, rows, ns.iters, ns.sweep,
                                  variants=tuple(ns.variants.split(",")),
                                  sweep_variants=tuple(ns.sweep_variants.split(",")),
                                  w8_forms=tuple(int(f) for f in ns.w8_forms.split(",") if f))
    doc = dict(device=torch.cuda.get_device_name(), hbm_gbps=HBM_GBPS, gemv_max_m=GEMV_MAX_M, w8_gemv_max_m=W8_GEMV_MAX_M,
               torch=torch.__version__, seconds=time.time() - t0, rows=results,
               per_layer=per_layer(results))
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(doc, indent=2))
    print(f"GEMV cut-offs M <= {GEMV_MAX_M} (int layout; 8 where the tensor-core GEMV reads it), "
          f"{W8_GEMV_MAX_M} (8-bit); GB/s against a {HBM_GBPS:.0f} GB/s ceiling")
    print(f"{'model':5} {'proj':8} {'M':>3} {'method':28} {'us':>8} {'GB/s':>7} {'%HBM':>5}")
    for r in results:
        head = f"{r['model']:5} {r['proj']:8} {r['M']:3d} {r['method']:28}"
        if "error" in r:
            print(f"{head} failed: {r['error'][:80]}")
            continue
        print(f"{head} {r['us']:8.1f} {r['GBps']:7.0f} {r['pct_hbm']:5.0f}"
              + (f"  {tuple(r['config'].values())}" if "sweep" in r["method"] else ""))
    print(f"{'model':5} {'method':28} {'M':>3} {'layer us':>9} {'tok/s bound':>11}")
    for r in doc["per_layer"]:
        print(f"{r['model']:5} {r['method']:28} {r['M']:3d} {r['layer_us']:9.1f} "
              f"{r['tok_s_bound']:11.0f}")
    print(f"({time.time() - t0:.0f} s; JSON in {ns.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
