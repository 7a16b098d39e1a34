"""Validate the sampler on a GPU (no host syncs, same tokens as the CPU, batch invariance), then time it.

Usage (H200): python benchmarks/gpu_sampler.py [--batch 256] [--vocab 151936]
CPU smoke run: python benchmarks/gpu_sampler.py --device cpu --batch 4 --vocab 5000
Prints per configuration: metadata build time on the host, sampler time (median), peak extra memory,
the fraction of rows whose token matches a CPU run of the same rows, and whether a row sampled alone
gets the same token as in the full batch. Writes $OUT/gpu_sampler.json when OUT is set; exits 1 when a
check fails (a host sync inside the sampler, batch dependence, or < 99% CPU agreement).
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

CONFIGS = {
    "greedy": dict(temperature=0.0),
    "plain": dict(temperature=1.0),
    "top_k=20 (compact)": dict(temperature=0.7, top_k=20),
    "top_p=0.9 (sort)": dict(temperature=0.6, top_p=0.9),
    "qwen: k=20 p=0.8": dict(temperature=0.7, top_k=20, top_p=0.8),
    "min_p=0.05": dict(min_p=0.05),
    "top_k=1000 (sort)": dict(top_k=1000),
    "penalties + k=20": dict(top_k=20, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2),
    "logprobs=5 + k=20": dict(top_k=20, logprobs=5),
}


def make_requests(batch: int, params: dict, prompt_len: int, output_len: int) -> list[Request]:
    reqs = []
    for i in range(batch):
        req = Request(f"r{i}", [(7 * i + j) % 1000 for j in range(prompt_len)], SamplingParams(**params),
                      arrival_time=0.0, eos_token_ids=(2,), max_tokens=4096, seed=1_000_003 * i + 17)
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


def check_config(name: str, params: dict, args, device: torch.device, sampler: Sampler) -> dict:
    reqs = make_requests(args.batch, params, args.prompt_len, args.output_len)
    gen = torch.Generator().manual_seed(0)
    logits_cpu = torch.randn(args.batch, args.vocab, generator=gen) * 3  # (B, V)
    logits = logits_cpu.to(device)
    t0 = time.perf_counter()
    meta = build_sampling_metadata(reqs, args.vocab, device)
    meta_ms = (time.perf_counter() - t0) * 1e3
    sampler(logits, meta)  # warm-up (and the token-hash table)
    sync_ok = True
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            build_sampling_metadata(reqs, args.vocab, device)
            sampler(logits, meta)
        except RuntimeError as e:
            sync_ok = False
            print(f"  host sync inside the metadata build or the sampler: {e}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    ms = time_ms(lambda: sampler(logits, meta), device, args.iters)
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else 0.0
    tokens = sampler(logits, meta).sampled_token_ids.cpu()
    n_cpu = min(args.batch, args.cpu_rows)
    cpu_meta = build_sampling_metadata(reqs[:n_cpu], args.vocab, "cpu")
    cpu_tokens = Sampler()(logits_cpu[:n_cpu], cpu_meta).sampled_token_ids
    cpu_match = float((cpu_tokens == tokens[:n_cpu]).float().mean())
    alone_ok = all(
        int(sampler(logits[i:i + 1], build_sampling_metadata([reqs[i]], args.vocab, device)).sampled_token_ids[0])
        == int(tokens[i]) for i in range(0, args.batch, max(1, args.batch // 8)))
    row = dict(config=name, batch=args.batch, vocab=args.vocab, meta_ms=meta_ms, sample_ms=ms, peak_mib=peak_mib,
               cpu_match=cpu_match, alone_matches_batch=alone_ok, no_host_sync=sync_ok)
    print(f"{name:22s} meta {meta_ms:7.2f} ms | sample {ms:7.3f} ms | peak +{peak_mib:7.1f} MiB | "
          f"cpu match {cpu_match:6.1%} | alone==batch {alone_ok} | no sync {sync_ok}")
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cpu-rows", type=int, default=32)
    args = ap.parse_args()
    device = torch.device(args.device)
    sampler = Sampler()
    rows = [check_config(name, params, args, device, sampler) for name, params in CONFIGS.items()]
    failed = [r["config"] for r in rows
              if not (r["no_host_sync"] and r["alone_matches_batch"] and r["cpu_match"] >= 0.99)]
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_sampler.json").write_text(json.dumps(rows, indent=1))
    print("FAILED: " + ", ".join(failed) if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
