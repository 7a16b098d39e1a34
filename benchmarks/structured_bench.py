"""What structured outputs cost: output tokens/s of one batch with no grammar, with every request
under a JSON schema, and with half of them under it, async scheduling on and off.

    python benchmarks/structured_bench.py                       # the packaged demo model
    python benchmarks/structured_bench.py --model /path/to/hf-folder --num-prompts 256

A step that samples a constrained row is not pipelined (its bitmask needs the previous token), so
the "all" and "half" rows under async scheduling show what losing the overlap costs next to
"none"; the grammar time (bitmask building and matcher updates in the core) is printed too. Every
constrained output is parsed as JSON and counted when it is valid.

Each engine is first warmed up with every mix at the full batch (fewer tokens), so no row pays a
one-time cost (a Triton variant, the pinned-memory cache growing) that the other engine, built
later in the same process, would find done; each row is the median of --repeats runs.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "id": {"type": "integer", "minimum": 0, "maximum": 100000},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
                         "ok": {"type": "boolean"}},
          "required": ["name", "id", "tags", "ok"], "additionalProperties": False}


def _run(llm, prompts, params) -> tuple[float, int, int, int]:
    """(seconds, output tokens, constrained outputs, valid JSON among them)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    constrained = valid = 0
    for o, p in zip(outs, params):
        if p.structured_outputs is None:
            continue
        constrained += 1
        try:
            json.loads(o.outputs[0].text)
            valid += 1
        except json.JSONDecodeError:
            pass
    return dt, tokens, constrained, valid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder with a tokenizer (default: the demo model)")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row (the median is shown)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    from peregrine import LLM, SamplingParams
    from peregrine.demo import demo_model_path
    from peregrine.structured_output import StructuredOutputsParams

    model = args.model or str(demo_model_path())
    prompts = [f"# record {i}\nrecord = " for i in range(args.num_prompts)]
    so = StructuredOutputsParams(json=SCHEMA)

    def params(constrained: bool, i: int, max_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens or args.max_tokens,
                              ignore_eos=not constrained,
                              structured_outputs=so if constrained else None)

    mixes = {"none": lambda i: False, "half": lambda i: i % 2 == 0, "all": lambda i: True}
    print(f"model {model}, {args.num_prompts} prompts, max_tokens {args.max_tokens}, {args.dtype}")
    print(f"{'async':>5} {'grammar':>7} {'tok/s':>9} {'tokens':>7} {'valid JSON':>11} {'grammar s':>9}")
    for async_scheduling in (True, False):
        llm = LLM(model, dtype=args.dtype, max_model_len=512, async_scheduling=async_scheduling)
        core = llm.engine.core_client.core if hasattr(llm.engine.core_client, "core") else None
        # NOTE: warm up every mix at the full batch (graphs, kernels, the grammar cache, pinned
        # buffers), then time from zero.
        for pick in mixes.values():
            llm.generate(prompts, [params(pick(i), i, 8) for i in range(args.num_prompts)],
                         use_tqdm=False)
        for name, pick in mixes.items():
            ps = [params(pick(i), i) for i in range(args.num_prompts)]
            runs = []
            for _ in range(args.repeats):
                if core is not None:
                    core.timing["structured"] = 0.0
                runs.append((*_run(llm, prompts, ps),
                             core.timing.get("structured", 0.0) if core is not None else None))
            dt, tokens, constrained, valid, grammar = sorted(runs, key=lambda r: r[1] / r[0])[
                len(runs) // 2]  # the median run by tok/s
            grammar_s = "n/a" if grammar is None else f"{grammar:.3f}"
            print(f"{str(async_scheduling):>5} {name:>7} {tokens / dt:9.0f} {tokens:7d} "
                  f"{valid:5d}/{constrained:<5d} {grammar_s:>9}")
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
