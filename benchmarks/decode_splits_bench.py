"""W1's paged decode attention over the whole run: split rule and launch config at every batch.

Usage (H200): python benchmarks/decode_splits_bench.py --out /tmp/splits.json
    [--caches bf16,fp8] [--every 100] [--layers 8] [--configs default,fixed,pps=16,block_n=32]
W1 (`peregrine bench throughput`: Qwen3-0.6B, 16 q / 8 kv heads, 256 requests, prompts of
100-1,024 tokens, outputs of 100-1,024, max_model_len 2,048) decodes with a batch that shrinks as
requests finish. At every --every-th decode step this times the decode attention of the
sequences still running at that step (their real prompt and output lengths, all admitted at
step 0, padded to the decode CUDA graph's batch size with empty sequences, a 2,048-token block
table, shuffled blocks, random K/V) over --layers layers with caches of their own (as a model's
layers are), captured in one CUDA graph and replayed; rounds of every config alternate and the
median is kept. Configs: "default" (the launcher's choice), or the default with knobs changed,
"knob=value[+knob=value]" over decode_configs.DecodeConfig's fields ("pps" is programs_per_sm,
"kvh" kv_heads_per_program); a leading "fixed" ("fixed", "fixed+pps=16") gives every sequence
one split length from the block table's width instead (the former rule).
Each config is checked against the default's output. Prints µs per layer per sampled step and
the attention time of the whole decode phase each config predicts (µs × 28 layers × steps
between samples). Dummy data.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_replay_ms  # noqa: E402
from peregrine.bench.offline import w1_requests  # noqa: E402
from peregrine.kernels import reference as ref  # noqa: E402
from peregrine.kernels._utils import has_fp8_convert, max_shared_memory, num_sms  # noqa: E402
from peregrine.kernels.decode_attention import (decode_num_splits,  # noqa: E402
                                                max_decode_splits, paged_decode_attention,
                                                pick_config)
from peregrine.kernels.decode_configs import DecodeConfig  # noqa: E402
from peregrine.worker.cuda_graphs import capture_sizes  # noqa: E402

HQ, HKV, HEAD_DIM, BLOCK_SIZE, LAYERS = 16, 8, 128, 16, 28
TABLE_TOKENS = 2048
K_SCALE, V_SCALE = 0.021, 0.017
CACHES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
DEV = torch.device("cuda")
ALIASES = {"pps": "programs_per_sm", "kvh": "kv_heads_per_program"}
# the launcher's choice, the former bf16 one (one split length per table, 4 programs per SM,
# 64-token tiles, sequence-major grid), and the split count moved either way
DEFAULT_CONFIGS = ("default", "fixed+pps=4+block_n=64+heads_first=0", "pps=4", "pps=32")


def w1_lens_at(step: int, seed: int = 0) -> list[int]:
    """Context lengths of the W1 sequences still decoding at this decode step."""
    prompts, out_lens = w1_requests(256, seed, 100, 1024, 100, 1024)
    return [len(p) + step for p, n in zip(prompts, out_lens) if n > step]


def make_problem(lens: list[int], cache: str, layers: int) -> dict:
    batch = next(s for s in capture_sizes(256) if s >= len(lens))
    gen = torch.Generator().manual_seed(len(lens))
    padded = torch.zeros(batch, dtype=torch.int64)
    padded[:len(lens)] = torch.tensor(lens)
    nbs = (padded + BLOCK_SIZE - 1) // BLOCK_SIZE
    perm = torch.randperm(int(nbs.sum()), generator=gen).to(torch.int32)
    table = torch.zeros(batch, TABLE_TOKENS // BLOCK_SIZE, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(nbs.tolist()):
        table[i, :nb] = perm[used:used + nb]
        used += nb
    shape = (used, BLOCK_SIZE, HKV, HEAD_DIM)
    ks, vs = (1.0, 1.0) if cache == "bf16" else (K_SCALE, V_SCALE)
    caches = []
    for _ in range(layers):
        kc = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
        vc = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
        if cache != "bf16":
            kc = ref.quantize_kv_ref(kc, CACHES[cache], ks)
            vc = ref.quantize_kv_ref(vc, CACHES[cache], vs)
        caches.append((kc, vc))
    q = torch.randn(batch, HQ, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    nbytes = 2.0 * sum(lens) * HKV * HEAD_DIM * caches[0][0].element_size()
    return dict(q=q, caches=caches, table=table.to(DEV), lens=padded.to(torch.int32).to(DEV),
                ks=ks, vs=vs, nbytes=nbytes, batch=batch)


def parse_config(spec: str, cache: str) -> tuple[str, DecodeConfig]:
    """("default" | "fixed" | knob changes, after "fixed+" for the former rule) -> (rule,
    config)."""
    cfg = pick_config(torch.bfloat16, CACHES[cache], HQ // HKV, True, max_shared_memory(DEV),
                      fp8_mma=torch.cuda.is_available() and has_fp8_convert(DEV))
    rule, _, spec = spec.partition("+") if spec.startswith("fixed") else ("per-seq", "", spec)
    changes = {}
    for part in spec.split("+") if spec not in ("", "default") else []:
        knob, value = part.split("=")
        knob = ALIASES.get(knob, knob)
        kind = type(getattr(cfg, knob))
        changes[knob] = value if kind is str else \
            (value.lower() in ("1", "true") if kind is bool else int(value))
    return rule, cfg._replace(**changes)


def launch(p: dict, layer: int, rule: str, cfg: DecodeConfig, out: torch.Tensor) -> None:
    splits = decode_num_splits(p["batch"], HKV // cfg.kv_heads_per_program,
                               p["table"].shape[1], BLOCK_SIZE, DEV, cfg.programs_per_sm)
    kw: dict = dict(num_splits=splits)
    if rule == "fixed":  # the former rule: the table's width over the split count, whole tiles
        kw = dict(split_len=math.ceil(math.ceil(TABLE_TOKENS / splits) / cfg.block_n)
                  * cfg.block_n)
    kc, vc = p["caches"][layer]
    paged_decode_attention(p["q"], kc, vc, p["table"], p["lens"], HEAD_DIM ** -0.5, out=out,
                           k_scale=p["ks"], v_scale=p["vs"], variant=cfg.variant,
                           block_n=cfg.block_n, num_warps=cfg.num_warps,
                           num_stages=cfg.num_stages, prefetch=cfg.prefetch,
                           clamp_tokens=cfg.clamp_tokens, aligned=cfg.aligned,
                           asm_cvt=cfg.asm_cvt, heads_first=cfg.heads_first,
                           kv_heads_per_program=cfg.kv_heads_per_program, **kw)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="write the results here as JSON")
    parser.add_argument("--caches", default="bf16,fp8", help=f"subset of {list(CACHES)}")
    parser.add_argument("--every", type=int, default=100, help="decode steps between samples")
    parser.add_argument("--layers", type=int, default=8, help="layers (caches) per graph")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
    parser.add_argument("--iters", type=int, default=10, help="graph replays per round")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help="comma-separated configs (see above; default: the launcher's, the "
                        "former bf16 one, and other split counts)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    steps = list(range(args.every // 2, 1024, args.every))
    print(f"device {torch.cuda.get_device_name()}  SMs {num_sms(DEV)}  torch {torch.__version__}"
          f"  max splits {max_decode_splits(TABLE_TOKENS)}", flush=True)
    rows, totals = [], {}
    t0 = time.time()
    for cache in args.caches.split(","):
        specs = args.configs.split(",")
        configs = [parse_config(c, cache) for c in specs]
        for step in steps:
            lens = w1_lens_at(step)
            if not lens:
                continue
            p = make_problem(lens, cache, args.layers)
            base = torch.empty_like(p["q"])
            launch(p, 0, *parse_config("default", cache), base)
            outs, times = {}, {spec: [] for spec in specs}
            for spec, (rule, cfg) in zip(specs, configs):
                outs[spec] = [torch.empty_like(p["q"]) for _ in range(args.layers)]
                launch(p, 0, rule, cfg, outs[spec][0])
                err = (outs[spec][0].float() - base.float()).abs().max().item()
                if err > 0.05:
                    print(f"  DIFFERENT RESULT {cache} step {step} {spec}: {err:.3g}")
            for _ in range(args.rounds):
                for spec, (rule, cfg) in zip(specs, configs):
                    calls = [lambda i=i, r=rule, c=cfg, o=outs[spec][i]: launch(p, i, r, c, o)
                             for i in range(args.layers)]
                    times[spec].append(graph_replay_ms(calls, args.iters) * 1e3 / args.layers)
            line = []
            for spec in specs:
                us = sorted(times[spec])[len(times[spec]) // 2]
                rows.append(dict(cache=cache, step=step, batch=len(lens), padded=p["batch"],
                                 mean_ctx=sum(lens) / len(lens), config=spec, us=us,
                                 rounds_us=times[spec], tbs=p["nbytes"] / us / 1e6))
                totals[cache, spec] = totals.get((cache, spec), 0.0) \
                    + us * LAYERS * args.every / 1e6
                line.append(f"{spec}:{us:6.1f}")
            print(f"{cache:4s} step {step:4d} B {len(lens):3d} ctx {sum(lens) / len(lens):5.0f} "
                  f"{p['nbytes'] / 1e6:4.0f} MB  " + "  ".join(line)
                  + f"  [{time.time() - t0:.0f} s]", flush=True)
            del p, outs
            torch.cuda.empty_cache()
    print("\npredicted decode-attention seconds over W1's decode steps (28 layers):")
    for (cache, spec), sec in totals.items():
        print(f"  {cache:4s} {spec:32s} {sec:.3f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, every=args.every,
        layers=args.layers, rows=rows,
        totals=[dict(cache=c, config=n, seconds=s) for (c, n), s in totals.items()]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
