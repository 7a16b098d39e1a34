"""Time the end of a decode step on a GPU: the LM head's logits and the sampling kernel.

Usage (H200, < 2 min): python benchmarks/logits_bench.py [--rows 1,143,256] [--out FILE]

LM head, per model head shape and row count: the two-pass form (16-bit GEMM, then a conversion
into the float32 logits buffer) against the GEMM that writes float32 itself
(`layers/embedding.FP32_OUT_GEMM`), each timed as a CUDA graph replay, and each one's largest
error against a float64 product (the float32-out GEMM skips one 16-bit rounding).
Sampling kernel (`kernels/sampling.gumbel_argmax`, W1's temperature 0.6, no threshold), float32
and bf16 logits, over a grid of launch settings (warps, programs per SM, block); every setting's
tokens must equal the default's (the result does not depend on the launch shape).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peregrine.kernels import sampling  # noqa: E402
from peregrine.layers import embedding  # noqa: E402
from peregrine.layers.embedding import ParallelLMHead  # noqa: E402
from peregrine.sample.noise import as_int32_bits, token_hashes  # noqa: E402

HEADS = {"qwen3-0.6b": (151936, 1024), "llama-3-8b": (128256, 4096)}


def graph_us(fn) -> float:
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3


def lm_head_rows(rows: list[int]) -> list[dict]:
    out = []
    for name, (vocab, hidden) in HEADS.items():
        head = ParallelLMHead(vocab, hidden, dtype=torch.bfloat16).cuda()
        head.weight.data.normal_(0, hidden ** -0.5)
        w64 = head.weight.double()
        for n in rows:
            x = torch.randn(n, hidden, device="cuda").to(torch.bfloat16)
            buf = torch.empty(n, vocab, device="cuda")
            ref = x.double() @ w64.t()  # (n, V)
            row = dict(head=name, rows=n)
            for form in (False, True):
                embedding.FP32_OUT_GEMM = form
                key = "fp32_out" if form else "two_pass"
                head.compute_logits(x, out=buf)
                row[f"{key}_max_err"] = float((buf.double() - ref).abs().max())
                row[f"{key}_us"] = graph_us(lambda: head.compute_logits(x, out=buf))
            embedding.FP32_OUT_GEMM = True
            print(f"lm head {name:11s} rows {n:4d}: two-pass {row['two_pass_us']:7.1f} us "
                  f"(err {row['two_pass_max_err']:.2e}) | fp32-out {row['fp32_out_us']:7.1f} us "
                  f"(err {row['fp32_out_max_err']:.2e})", flush=True)
            out.append(row)
        del head
        torch.cuda.empty_cache()
    return out


def sampler_rows(rows: list[int]) -> list[dict]:
    vocab = HEADS["qwen3-0.6b"][0]
    table = as_int32_bits(token_hashes(torch.arange(vocab, device="cuda")))
    defaults = (sampling._NUM_WARPS, sampling._PROGRAMS_PER_SM)
    grid = list(itertools.product((4, 8), (8, 16), (512, 1024)))
    out = []
    for n, dtype in itertools.product(rows, (torch.float32, torch.bfloat16)):
        logits = (torch.randn(n, vocab, device="cuda") * 3).to(dtype)
        temp = torch.full((n,), 0.6, device="cuda")
        seeds = torch.arange(n, device="cuda", dtype=torch.int64) * 7919 + 3
        steps = torch.full((n,), 400, device="cuda", dtype=torch.int64)
        want = sampling.gumbel_argmax(logits, temp, seeds, steps, table)
        for warps, pps, block in grid:
            sampling._NUM_WARPS, sampling._PROGRAMS_PER_SM = warps, pps
            got = sampling.gumbel_argmax(logits, temp, seeds, steps, table, block=block)
            us = graph_us(lambda: sampling.gumbel_argmax(logits, temp, seeds, steps, table, block=block))
            row = dict(rows=n, dtype=str(dtype), warps=warps, pps=pps, block=block, us=us,
                       same_tokens=bool(torch.equal(got, want)))
            out.append(row)
        sampling._NUM_WARPS, sampling._PROGRAMS_PER_SM = defaults
        mine = [r for r in out if r["rows"] == n and r["dtype"] == str(dtype)]
        best = min(mine, key=lambda r: r["us"])
        base = next(r for r in mine if (r["warps"], r["pps"], r["block"]) == (*defaults, 1024))
        bad = [r for r in mine if not r["same_tokens"]]
        print(f"sampler rows {n:4d} {str(dtype):15s}: default {base['us']:6.1f} us | best {best['us']:6.1f} "
              f"us (warps {best['warps']}, {best['pps']} programs/SM, block {best['block']})"
              f"{' | TOKENS DIFFER in ' + str(len(bad)) if bad else ''}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,143,256")
    ap.add_argument("--lm-head-rows", default=None, help="LM head rows when not --rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",") if r]
    head_rows = [int(r) for r in args.lm_head_rows.split(",")] if args.lm_head_rows else rows
    result = dict(lm_head=lm_head_rows(head_rows), sampler=sampler_rows(rows) if rows else [])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
