"""Weight-only int quantization on the GPU: (a) the dequant-GEMM's and the small-batch GEMV's
achieved GB/s at batch 1 for Llama-3-8B's projections against the HBM ceiling, beside bf16
F.linear; (b) Llama-3-8B batch-1 decode tok/s with dummy weights: bf16, int4 (AWQ layout, group
128), int6 and int8 RTN, each through `peregrine bench latency` in its own process, in one table.

Usage: python benchmarks/quant_bench.py [--skip-e2e] [--output-json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HBM_GBPS = 4200.0
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cuda_timing import graph_replay_ms  # noqa: E402
CONFIG = ROOT / "benchmarks" / "configs" / "llama-3-8b.json"
SHAPES = {"qkv": (4096, 4096 + 2 * 1024), "o": (4096, 4096), "gate_up": (4096, 2 * 14336),
          "down": (14336, 4096)}


def _time_ms(fn, iters: int = 200) -> float:
    """Mean ms of `iters` replays of a CUDA graph of fn (no launch overhead)."""
    return graph_replay_ms([fn], iters)


def _dense_ms(x: torch.Tensor, n: int) -> float:
    dense = torch.randn(n, x.shape[1], device=x.device, dtype=x.dtype) * 0.02  # (N, K)
    return _time_ms(lambda: torch.nn.functional.linear(x, dense))


def kernel_rows() -> list[dict]:
    from peregrine.kernels.wna16_gemm import choose_config, wna16_gemm, _num_sms
    from peregrine.kernels.wna16_gemv import gemv_config, wna16_gemv
    from peregrine.layers.quantization.wna16 import WNA16Layout
    dev, rows = torch.device("cuda"), []
    for name, (k, n) in SHAPES.items():
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ms = _dense_ms(x, n)
        rows.append(dict(shape=name, K=k, N=n, weights="bf16", ms=ms, GBps=n * k * 2 / ms / 1e6))
        for bits, zp in ((4, True), (6, False), (8, False)):
            q = torch.randint(0, 1 << bits, (k, n), device=dev, dtype=torch.int32)
            scales = torch.rand(k // 128, n, device=dev) * 0.01
            zeros = torch.randint(0, 1 << bits, (k // 128, n), device=dev).float() if zp else None
            w = WNA16Layout.build(q, scales, zeros, None, bits, torch.bfloat16)
            del q
            moved = sum(t.numel() * t.element_size() for t in w.tensors().values()) + (k + n) * 2
            label = f"int{bits}" + ("+zp" if zp else "")
            ms = _time_ms(lambda: wna16_gemm(x, w))
            cfg = choose_config(1, n, k, 128, False, _num_sms(dev.index), bits)
            rows.append(dict(shape=name, K=k, N=n, weights=label, kernel="GEMM", ms=ms,
                             GBps=moved / ms / 1e6, split_k=cfg.split_k))
            # the path a decode step takes (layers/quantization/wna16.py: M <= max_rows)
            ms = _time_ms(lambda: wna16_gemv(x, w))
            rows.append(dict(shape=name, K=k, N=n, weights=label, kernel="GEMV", ms=ms,
                             GBps=moved / ms / 1e6,
                             split_k=gemv_config(w, dev).split_k))
    return rows


def _latency(model: str, quantization: str | None, out_dir: Path) -> dict:
    out = out_dir / f"w2-{quantization or 'bf16'}.json"
    cmd = [sys.executable, "-m", "peregrine.entrypoints.cli", "bench", "latency", "--model", model,
           "--output-json", str(out)]
    if quantization:
        cmd += ["--quantization", quantization]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(out.read_text())


def e2e_rows(out_dir: Path) -> list[dict]:
    awq_cfg = json.loads(CONFIG.read_text())
    awq_cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128,
                                      "zero_point": True, "version": "gemm"}
    awq_path = out_dir / "llama-3-8b-awq.json"
    awq_path.write_text(json.dumps(awq_cfg))
    rows = []
    for label, model, quant in (("bf16", CONFIG, None), ("int4 AWQ g128", awq_path, None),
                                ("int6 RTN g128", CONFIG, "rtn-int6"),
                                ("int8 RTN g128", CONFIG, "rtn-int8")):
        r = _latency(str(model), quant, out_dir)
        r["label"] = label
        rows.append(r)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-e2e", action="store_true", help="only the kernel table")
    p.add_argument("--output-json", default=None)
    ns = p.parse_args()
    if not torch.cuda.is_available():
        print("quant_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    result: dict = {"kernel_m1": kernel_rows()}
    print(f"\n(a) dequant-GEMM and GEMV at M=1 (ceiling {HBM_GBPS:.0f} GB/s)")
    print(f"{'shape':8} {'K':>6} {'N':>6} {'weights':9} {'kernel':6} {'us':>8} {'GB/s':>7} "
          f"{'% HBM':>6} split")
    for r in result["kernel_m1"]:
        print(f"{r['shape']:8} {r['K']:6d} {r['N']:6d} {r['weights']:9} {r.get('kernel', ''):6} "
              f"{r['ms'] * 1e3:8.1f} {r['GBps']:7.0f} {100 * r['GBps'] / HBM_GBPS:5.0f}% "
              f"{r.get('split_k', '')}")
    if not ns.skip_e2e:
        with tempfile.TemporaryDirectory() as d:
            result["e2e"] = e2e_rows(Path(d))
        print("\n(b) Llama-3-8B batch-1 decode, dummy weights (peregrine bench latency)")
        print(f"{'weights':15} {'weight GiB':>10} {'tok/s':>8} {'GB/s':>7} {'ceiling tok/s':>13}")
        for r in result["e2e"]:
            if "error" in r:
                print(f"{r['label']:15} failed: {r['error'][-400:]}")
                continue
            ceiling = HBM_GBPS * 1e9 / r["weight_bytes"]
            print(f"{r['label']:15} {r['weight_bytes'] / 2**30:10.2f} "
                  f"{r['decode_tokens_per_s']:8.1f} {r['achieved_GBps']:7.0f} {ceiling:13.0f}")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
