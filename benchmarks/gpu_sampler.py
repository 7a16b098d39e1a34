"""Time the sampler's pure-torch path against the fused Triton kernel on a GPU.

Usage (H200, < 60 s): python benchmarks/gpu_sampler.py [--batches 1,64,256] [--vocab 151936]
CPU smoke run:
    TRITON_INTERPRET=1 python benchmarks/gpu_sampler.py --device cpu --batches 1,3 --vocab 3000 --iters 1

Per (config, batch): host time of build_sampling_metadata (to CPU tensors), median sampler time and peak
extra memory of each path, and how many rows the two paths disagree on (expected 0: same noise, same
thresholds). Writes $OUT/gpu_sampler.json when OUT is set. The kernel's correctness (same tokens as the
torch formula, batch invariance, no host sync) is tested by python -m pytest -m gpu tests/gpu.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peregrine.engine.request import Request  # noqa: E402
from peregrine.sample import Sampler, build_sampling_metadata  # noqa: E402
from peregrine.sampling_params import SamplingParams  # noqa: E402

W1 = dict(temperature=0.6)  # the W1 workload: Qwen3-0.6B, no top-k/top-p
CONFIGS: dict[str, tuple[list[dict], torch.dtype]] = {
    "W1 T=0.6": ([W1], torch.float32),
    "W1 T=0.6 bf16": ([W1], torch.bfloat16),
    "greedy": ([dict(temperature=0.0)], torch.float32),
    "half greedy": ([W1, dict(temperature=0.0)], torch.float32),
    "top_p=0.9": ([dict(temperature=0.6, top_p=0.9)], torch.float32),
    "min_p=0.05": ([dict(min_p=0.05)], torch.float32),
    "top_k=20 (compact)": ([dict(temperature=0.7, top_k=20)], torch.float32),
    "top_k=1000": ([dict(top_k=1000)], torch.float32),
    "penalties": ([dict(temperature=0.6, repetition_penalty=1.1, presence_penalty=0.5,
                        frequency_penalty=0.2)], torch.float32),
    "logprobs=5": ([dict(temperature=0.6, logprobs=5)], torch.float32),
}


def make_requests(batch: int, params: list[dict], prompt_len: int, output_len: int) -> list[Request]:
    reqs = []
    for i in range(batch):
        req = Request(f"r{i}", [(7 * i + j) % 1000 for j in range(prompt_len)],
                      SamplingParams(**params[i % len(params)]), arrival_time=0.0, eos_token_ids=(2,),
                      max_tokens=4096, seed=1_000_003 * i + 17)
        for j in range(output_len):
            req.append_output_token((13 * i + 5 * j) % 5000)
        reqs.append(req)
    return reqs


def time_ms(fn, device: torch.device, iters: int) -> float:
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_mib(fn, device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def check(name: str, params: list[dict], dtype: torch.dtype, batch: int, args, device: torch.device,
          samplers: dict[str, Sampler]) -> dict:
    reqs = make_requests(batch, params, args.prompt_len, args.output_len)
    gen = torch.Generator().manual_seed(batch)
    logits_cpu = (torch.randn(batch, args.vocab, generator=gen) * 3).to(dtype)  # (B, V)
    logits = logits_cpu.to(device)
    meta = build_sampling_metadata(reqs, args.vocab, device)
    meta_ms = time_ms(lambda: build_sampling_metadata(reqs, args.vocab, "cpu"), torch.device("cpu"), 5)
    row: dict = dict(config=name, batch=batch, vocab=args.vocab, dtype=str(dtype), meta_ms=meta_ms)
    tokens = {}
    for path, sampler in samplers.items():
        tokens[path] = sampler(logits, meta).sampled_token_ids.cpu()  # warm-up (compile, hash tables)
        row[f"{path}_ms"] = time_ms(lambda: sampler(logits, meta), device, args.iters)
        row[f"{path}_peak_mib"] = peak_mib(lambda: sampler(logits, meta), device)
    row["kernel_vs_torch_mismatches"] = int((tokens["kernel"] != tokens["torch"]).sum())
    speedup = row["torch_ms"] / max(row["kernel_ms"], 1e-9)
    print(f"{name:19s} B={batch:<4d} meta {meta_ms:6.3f} ms | torch {row['torch_ms']:7.3f} ms "
          f"+{row['torch_peak_mib']:5.0f} MiB | kernel {row['kernel_ms']:7.3f} ms "
          f"+{row['kernel_peak_mib']:5.0f} MiB | x{speedup:5.1f} | differ {row['kernel_vs_torch_mismatches']}")
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    device = torch.device(args.device)
    start = time.perf_counter()
    samplers = {"torch": Sampler(use_kernel=False), "kernel": Sampler(use_kernel=True)}
    rows = [check(name, params, dtype, int(b), args, device, samplers)
            for b in args.batches.split(",") for name, (params, dtype) in CONFIGS.items()]
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_sampler.json").write_text(json.dumps(dict(rows=rows), indent=1))
    print(f"total {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
