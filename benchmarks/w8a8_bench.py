"""Batch-1 decode tok/s of a dummy-weight model in bf16, online FP8 W8A8 and compressed-tensors
INT8 W8A8, side by side (W2's latency loop), plus a per-projection GEMM table at batch 1.

    python benchmarks/w8a8_bench.py --model benchmarks/configs/llama-3-8b.json \
        --output-json /tmp/out/w8a8.json

Each mode builds its own engine (dummy weights, CUDA graphs) and frees it before the next.
The GEMM table times, per Llama-3-8B projection at M tokens: bf16 F.linear, FP8 per-channel
(per-token quant + torch._scaled_mm), INT8 (per-token quant + torch._int_mm), block FP8
(per-group quant + Triton block GEMM) and block FP8 dequantized to bf16 + F.linear; it says
which block path wins at batch 1.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peregrine.testing.fp8_pack import compressed_tensors_config  # noqa: E402

MODES = ("bf16", "fp8", "int8")
HBM_GBPS = 4800.0  # H200
LLAMA3_8B = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
             ("down", 14336, 4096)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _model_dir(config: Path, mode: str, tmp: Path) -> tuple[str, str | None]:
    """(model folder, --quantization) for a mode: int8 writes the compressed-tensors config."""
    hf = json.loads(config.read_text())
    if mode == "int8":
        hf["quantization_config"] = compressed_tensors_config("int8_dynamic")
    folder = tmp / mode
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    return str(folder), ("fp8" if mode == "fp8" else None)


def decode_latency(model: str, quantization: str | None, ns: argparse.Namespace) -> dict[str, Any]:
    """W2: one request, greedy, input_len then output_len tokens; the median decode tok/s."""
    from peregrine.config import EngineArgs
    from peregrine.engine.llm_engine import LLMEngine
    from peregrine.sampling_params import SamplingParams
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, load_format="dummy", dtype="bfloat16", quantization=quantization,
        skip_tokenizer_init=True, max_model_len=ns.input_len + ns.output_len + 16, seed=0))
    random.seed(0)
    prompt = [random.randint(0, 10000) for _ in range(ns.input_len)]
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    decodes = []
    for it in range(ns.warmup + ns.iters):
        engine.add_request(f"w8a8-{it}", prompt, params)
        _sync()
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    _sync()
                    first = time.perf_counter()
        _sync()
        if it >= ns.warmup:
            decodes.append(time.perf_counter() - first)
    decode = sorted(decodes)[len(decodes) // 2]
    model_obj = engine.core_client.core.executor.worker.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model_obj.parameters())
    methods = sorted({type(m.quant_method).__name__ for m in model_obj.modules()
                      if hasattr(m, "quant_method")})
    tps = (ns.output_len - 1) / decode
    del engine, model_obj
    gc.collect()
    torch.cuda.empty_cache()
    return {"decode_tokens_per_s": tps, "weight_bytes": weight_bytes, "methods": methods,
            "weight_GBps": weight_bytes * tps / 1e9}


def _time(fn, iters: int = 50) -> float:
    """Median microseconds of fn() over CUDA events (after a warm-up call)."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def gemm_table(m: int) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    from peregrine.kernels.fp8_quant import (FP8_DTYPE, block_dequantize, per_token_group_quant,
                                             w8a8_block_fp8_matmul)
    from peregrine.layers.quantization.fp8 import apply_fp8_linear
    from peregrine.layers.quantization.int8 import apply_int8_linear
    from peregrine.testing.fp8_pack import quantize_blocks, quantize_per_channel
    rows = []
    for name, k, n in LLAMA3_8B:
        w = torch.randn(n, k, device="cuda") * 0.02
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        wb = w.bfloat16()
        fq, fs = quantize_per_channel(w, FP8_DTYPE)
        fs = fs.t().contiguous()
        iq, is_ = quantize_per_channel(w, torch.int8)
        is_ = is_.t().contiguous()
        bq, bs = quantize_blocks(w, (128, 128))
        del w

        def block_gemm():
            xq, xs = per_token_group_quant(x, FP8_DTYPE, 128)
            return w8a8_block_fp8_matmul(xq, xs, bq, bs, (128, 128), torch.bfloat16)

        def block_dequant():
            return F.linear(x, block_dequantize(bq, bs, (128, 128)).to(torch.bfloat16))

        row = {"proj": name, "M": m, "K": k, "N": n,
               "bf16_us": _time(lambda: F.linear(x, wb)),
               "fp8_scaled_mm_us": _time(lambda: apply_fp8_linear(x, fq, fs, None, None)),
               "int8_int_mm_us": _time(lambda: apply_int8_linear(x, iq, is_, None, None)),
               "fp8_block_triton_us": _time(block_gemm),
               "fp8_block_dequant_us": _time(block_dequant)}
        rows.append(row)
        del wb, fq, iq, bq
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="benchmarks/configs/llama-3-8b.json",
                   help="a config .json (dummy weights)")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of bf16, fp8, int8")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--gemm-batches", default="1,16", help="M values of the GEMM table ('' skips)")
    p.add_argument("--output-json", default=None)
    ns = p.parse_args(argv)
    modes = [m for m in ns.modes.split(",") if m]
    bad = sorted(set(modes) - set(MODES))
    if bad:
        p.error(f"unknown mode(s) {', '.join(bad)} (expected {', '.join(MODES)})")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    result: dict[str, Any] = {"model": ns.model, "gpu": torch.cuda.get_device_name(),
                              "torch": torch.__version__, "decode": {}, "gemm": []}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            folder, quant = _model_dir(Path(ns.model), mode, Path(tmp))
            result["decode"][mode] = decode_latency(folder, quant, ns)
    print(f"{'mode':<6} {'decode tok/s':>12} {'weights GB':>10} {'weight GB/s':>11}  methods")
    base = result["decode"].get("bf16", {}).get("decode_tokens_per_s")
    for mode, r in result["decode"].items():
        speed = f"  x{r['decode_tokens_per_s'] / base:.2f}" if base else ""
        print(f"{mode:<6} {r['decode_tokens_per_s']:>12.1f} {r['weight_bytes'] / 1e9:>10.2f} "
              f"{r['weight_GBps']:>11.0f}  {','.join(r['methods'])}{speed}")
    print(f"(HBM ceiling ~{HBM_GBPS:.0f} GB/s)")
    for m in [int(b) for b in ns.gemm_batches.split(",") if b]:
        result["gemm"] += gemm_table(m)
    if result["gemm"]:
        keys = [k for k in result["gemm"][0] if k.endswith("_us")]
        print(f"{'proj':<8} {'M':>5} " + " ".join(f"{k[:-3]:>20}" for k in keys))
        for r in result["gemm"]:
            print(f"{r['proj']:<8} {r['M']:>5} " + " ".join(f"{r[k]:>20.1f}" for k in keys))
        for m in sorted({r["M"] for r in result["gemm"]}):
            rows = [r for r in result["gemm"] if r["M"] == m]
            tri = sum(r["fp8_block_triton_us"] for r in rows)
            deq = sum(r["fp8_block_dequant_us"] for r in rows)
            print(f"block FP8 at M={m}: Triton GEMM {tri:.0f} us vs dequantize+bf16 {deq:.0f} us "
                  f"per layer -> {'Triton' if tri <= deq else 'dequantize'} is faster")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
