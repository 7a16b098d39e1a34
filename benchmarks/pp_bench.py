"""Tensor vs pipeline parallelism: batch-1 decode speed and batched offline throughput for one
GPU (tp1), two GPUs by tensor parallelism (tp2) and two by pipeline parallelism (pp2), with each
pipeline stage's idle fraction (the bubble).

    python benchmarks/pp_bench.py --model benchmarks/configs/llama-3-8b.json \
        --output-json /tmp/out/pp.json

Each setup builds its own engine (dummy weights, no tokenizer: token-id prompts), warms it up,
then runs (1) one request of --input-len tokens generating --batch1-output-len tokens and (2)
--num-prompts requests of --input-len tokens generating --output-len tokens each, submitted at
once. For pp setups the workers time each stage: `busy_s` is the time a stage worked on steps,
`span_s` the time from its first step's start to its last step's end, `idle_fraction` = 1 -
busy / span (on CUDA from events on the stage's stream, so waiting for the previous stage's
hidden states counts as idle).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETUPS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}


def _model_dir(model: str, tmp: Path) -> str:
    """A model folder: the path itself, or a folder holding a config.json given as a file."""
    path = Path(model)
    if path.is_dir():
        return str(path)
    folder = tmp / path.stem
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(path.read_text())
    return str(folder)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def _run(llm, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from peregrine import SamplingParams
    core = llm.engine.core_client.core
    core.executor.stage_stats(reset=True)
    core.pipeline.max_in_flight = 0
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    stages = core.executor.stage_stats()
    return {"requests": len(prompts), "seconds": elapsed,
            "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (out_tokens + in_tokens) / elapsed,
            "max_steps_in_flight": core.pipeline.max_in_flight or 1,
            "stages": stages,
            "idle_fraction": [s["idle_fraction"] for s in stages]}


def bench_setup(name: str, model_dir: str, ns: argparse.Namespace) -> dict[str, Any]:
    from peregrine import LLM
    tp, pp = SETUPS[name]
    extra: dict[str, Any] = {}
    if ns.gpu_memory_utilization is not None:
        extra["gpu_memory_utilization"] = ns.gpu_memory_utilization
    if ns.num_gpu_blocks is not None:
        extra["num_gpu_blocks_override"] = ns.num_gpu_blocks
    llm = LLM(model_dir, load_format="dummy", dtype=ns.dtype, skip_tokenizer_init=True,
              device=ns.device, max_model_len=ns.input_len + max(ns.output_len,
                                                                  ns.batch1_output_len) + 16,
              max_num_seqs=ns.max_num_seqs, enable_prefix_caching=False, seed=0,
              tensor_parallel_size=tp, pipeline_parallel_size=pp, **extra)
    try:
        vocab = llm.engine.config.model.vocab_size
        _run(llm, _prompts(2, 16, vocab, seed=1), 4)  # warm-up
        batch1 = _run(llm, _prompts(1, ns.input_len, vocab, seed=2), ns.batch1_output_len)
        batched = _run(llm, _prompts(ns.num_prompts, ns.input_len, vocab, seed=3), ns.output_len)
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
    result = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "batch1": batch1,
              "batched": batched}
    print(f"{name:7s} batch-1 {batch1['output_tokens_per_s']:9.1f} tok/s | batched "
          f"{batched['output_tokens_per_s']:9.1f} out tok/s ({batched['total_tokens_per_s']:.1f} "
          f"total), idle per stage {_fmt(batched['idle_fraction'])} (batch-1: "
          f"{_fmt(batch1['idle_fraction'])}), steps in flight {batched['max_steps_in_flight']}",
          flush=True)
    return result


def _fmt(fractions: list[float]) -> str:
    return "[" + ", ".join(f"{f:.2f}" for f in fractions) + "]" if fractions else "-"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="benchmarks/configs/llama-3-8b.json",
                    help="a model folder, or a config.json (dummy weights)")
    ap.add_argument("--setups", default="tp1,tp2,pp2",
                    help=f"comma-separated, from {', '.join(SETUPS)}")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch1-output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks (default: sized)")
    ap.add_argument("--output-json", default=None, help="where to write the results")
    ns = ap.parse_args(argv)
    names = [s.strip() for s in ns.setups.split(",") if s.strip()]
    unknown = [n for n in names if n not in SETUPS]
    if unknown or not names:
        ap.error(f"unknown setup(s) {unknown}: choose from {', '.join(SETUPS)}")
    results: dict[str, Any] = {"model": ns.model, "dtype": ns.dtype, "input_len": ns.input_len,
                               "output_len": ns.output_len, "num_prompts": ns.num_prompts,
                               "setups": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(ns.model, Path(tmp))
        for name in names:
            results["setups"][name] = bench_setup(name, model_dir, ns)
    if ns.output_json:
        out = Path(ns.output_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
