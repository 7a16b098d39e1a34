"""Speculative decoding with a draft model on the GPU: output tokens/s with and without a draft,
the acceptance rate, the mean acceptance length and the share of wall time spent proposing.

Cases (greedy, ignore_eos, bf16):
- demo: the demo model alone, then with the demo draft (k = 2 and 4), on Python prompts;
- 8b: Llama-3-8B's shape with dummy weights alone, then drafted by its own weights quantized
  online (rtn 4-bit, fp8; k = 3), on random token prompts.
Each case runs batch sizes 1 and 16 after a warm-up. `same_as_plain` is the share of requests
whose tokens equal the run without a draft (bf16 verification may differ at near-ties).

Usage: python benchmarks/draft_bench.py --output-json PATH [--cases demo,8b] [--output-len N]
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

import torch

from peregrine import LLM, SamplingParams
from peregrine import demo
from peregrine.entrypoints.model_path import model_folder

ROOT = Path(__file__).resolve().parent.parent
CONFIG_8B = ROOT / "benchmarks" / "configs" / "llama-3-8b.json"
PY_PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):",
              "import os\n\n\ndef read_lines(path):\n    \"\"\"", "    for i in range(10):",
              "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
              "# sort a list\n", "with open(path) as f:\n", "try:\n    import json\n"]
BATCHES = (1, 16)


def _prompts(kind: str, n: int) -> list:
    if kind == "demo":
        return [PY_PROMPTS[i % len(PY_PROMPTS)] + f"  # {i}\n" for i in range(n)]
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randint(0, 10000) for _ in range(64)]} for _ in range(n)]


# NOTE: graphs for up to 32 sequences and 512-token chunks: enough for these batches, and the
# captures of six engines stay within the run's few minutes.
ENGINE = dict(seed=0, dtype="bfloat16", max_num_seqs=32, max_prefill_graph_tokens=512)


def _case(name: str, kind: str, model: str, spec: dict | None, engine: dict, out_len: int,
          plain: dict[int, list[list[int]]] | None) -> tuple[dict, dict[int, list[list[int]]]]:
    llm = LLM(model, speculative_config=spec, **{**ENGINE, **engine})
    worker = llm.engine.core_client.core.executor.worker
    proposer = getattr(worker, "proposer", None)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(_prompts(kind, 4), SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    rows, tokens = [], {}
    for b in BATCHES:
        before, timing = llm.engine.get_stats(), worker.model_runner.timing
        propose0, steps0 = timing.get("propose", 0.0), timing.get("steps", 0.0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(_prompts(kind, b), params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        after = llm.engine.get_stats()
        toks = [list(o.outputs[0].token_ids) for o in outs]
        tokens[b] = toks
        drafts = after.spec_num_drafts - before.spec_num_drafts
        proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        row = dict(case=name, batch=b, output_tokens_per_s=sum(map(len, toks)) / wall,
                   wall_s=wall, steps=timing.get("steps", 0.0) - steps0,
                   propose_share=(timing.get("propose", 0.0) - propose0) / wall,
                   acceptance_rate=accepted / proposed if proposed else None,
                   mean_acceptance_length=1 + accepted / drafts if drafts else None,
                   draft_graphs=getattr(proposer, "graphs", None) is not None)
        if plain is not None:
            row["same_as_plain"] = sum(a == p for a, p in zip(toks, plain[b])) / b
        rows.append(row)
        print(json.dumps(row), flush=True)
    del llm, worker, proposer
    gc.collect()
    torch.cuda.empty_cache()
    return {"rows": rows}, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json", required=True)
    ap.add_argument("--cases", default="demo,8b")
    ap.add_argument("--output-len", type=int, default=128)
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("draft_bench needs a CUDA GPU")
    results: list[dict] = []
    cases = ns.cases.split(",")
    if "demo" in cases:
        target, draft = str(demo.demo_model_path()), str(demo.demo_draft_path())
        engine = dict(max_model_len=512)
        res, plain = _case("demo", "demo", target, None, engine, ns.output_len, None)
        results += res["rows"]
        for k in (2, 4):
            spec = {"model": draft, "num_speculative_tokens": k}
            results += _case(f"demo+draft k={k}", "demo", target, spec, engine, ns.output_len,
                             plain)[0]["rows"]
    if "8b" in cases:
        folder = model_folder(str(CONFIG_8B))
        engine = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=1024)
        res, plain = _case("8b", "ids", folder, None, engine, ns.output_len, None)
        results += res["rows"]
        for quant in ("rtn", "fp8"):
            spec = {"model": folder, "quantization": quant, "num_speculative_tokens": 3}
            results += _case(f"8b+self-{quant} k=3", "ids", folder, spec, engine,
                             ns.output_len, plain)[0]["rows"]
    Path(ns.output_json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                "rows": results}, indent=1))
    print(f"{'case':24} {'batch':>5} {'tok/s':>9} {'accept':>7} {'len':>5} {'propose':>8}")
    for r in results:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        ln = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        print(f"{r['case']:24} {r['batch']:>5} {r['output_tokens_per_s']:>9.1f} {acc:>7} "
              f"{ln:>5} {r['propose_share']:>8.1%}")


if __name__ == "__main__":
    main()
