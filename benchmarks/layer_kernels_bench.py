"""Time the attention layer's step between the qkv GEMM and attention, per layer, inside a CUDA
graph: the separate kernels (Qwen3: q RMSNorm and k RMSNorm with the copies their strided inputs
need, RoPE, store_kv; Llama: RoPE, store_kv) against the fused norm_rope_store, at batch 1 to
4,096 tokens, bf16 and FP8 caches.

Usage (one GPU): python benchmarks/layer_kernels_bench.py OUT.json [--layers 28] [--replays 50]
Prints microseconds per layer for each case and the saving; writes every row to OUT.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_replay_ms  # noqa: E402
from peregrine.kernels.rmsnorm import rms_norm  # noqa: E402
from peregrine.kernels.rope_store import norm_rope_store  # noqa: E402
from peregrine.kernels.rotary import apply_rope  # noqa: E402
from peregrine.kernels.store_kv import store_kv  # noqa: E402

DEV = torch.device("cuda")
MODELS = {"qwen3-0.6b": (16, 8, 128, True), "llama-3-8b": (32, 8, 128, False)}
BLOCK = 16


def _inputs(tokens: int, hq: int, hkv: int, d: int, cache_dtype: torch.dtype):
    qkv = torch.randn(tokens, hq + 2 * hkv, d, device=DEV, dtype=torch.bfloat16)  # (T, H, D)
    num_blocks = tokens // BLOCK + 1
    kc = torch.zeros(num_blocks, BLOCK, hkv, d, device=DEV).to(cache_dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(num_blocks * BLOCK, device=DEV)[:tokens]  # (T,)
    pos = torch.randint(0, 4096, (tokens,), device=DEV)  # (T,)
    inv = 1.0 / 1e6 ** (torch.arange(0, d, 2, device=DEV).float() / d)
    freqs = torch.outer(torch.arange(4096, device=DEV).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # (4096, D)
    w = torch.ones(d, device=DEV, dtype=torch.bfloat16)
    return qkv, kc, vc, slots, pos, cache, w


def _separate(qkv, kc, vc, slots, pos, cache, w, hq, hkv, qk_norm, scale):
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    if qk_norm:
        q, k = rms_norm(q, w, 1e-6), rms_norm(k, w, 1e-6)
    apply_rope(q, k, pos, cache)
    store_kv(k, v, kc, vc, slots, scale, scale)


def _fused(qkv, kc, vc, slots, pos, cache, w, hq, hkv, qk_norm, scale):
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    norm = dict(q_weight=w, k_weight=w) if qk_norm else {}
    norm_rope_store(q, k, v, pos, cache, kc, vc, slots, scale, scale, **norm)


def time_per_layer(fn, args, layers: int, replays: int) -> float:
    """Microseconds per layer of `layers` calls captured in one CUDA graph."""
    call = functools.partial(fn, *args)
    return graph_replay_ms([call] * layers, replays, warmup=3) * 1e3 / layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON file for the results")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("layer_kernels_bench.py needs a CUDA GPU")
    rows = []
    for model, (hq, hkv, d, qk_norm) in MODELS.items():
        for cache_dtype, scale in ((torch.bfloat16, 1.0), (torch.float8_e4m3fn, 0.5)):
            for tokens in (1, 16, 64, 256, 4096):
                inputs = _inputs(tokens, hq, hkv, d, cache_dtype)
                extra = (hq, hkv, qk_norm, scale)
                sep = time_per_layer(_separate, (*inputs, *extra), args.layers, args.replays)
                fused = time_per_layer(_fused, (*inputs, *extra), args.layers, args.replays)
                row = dict(model=model, cache=str(cache_dtype).split(".")[-1], tokens=tokens,
                           separate_us=sep, fused_us=fused, saved_us=sep - fused)
                rows.append(row)
                print(f"{model:11s} {row['cache']:14s} T={tokens:5d}  separate {sep:7.2f} us  "
                      f"fused {fused:7.2f} us  saved {sep - fused:6.2f} us/layer", flush=True)
    Path(args.out).write_text(json.dumps(dict(layers=args.layers, rows=rows), indent=1))


if __name__ == "__main__":
    main()
