"""Tokens per step of n-gram speculation at batch 1 for many settings, without re-running the model.

Greedy speculation is lossless, so a request's tokens are the plain greedy run's whatever the
settings: a verify step emits the drafts that agree with those tokens, then one more. This script
generates the plain greedy outputs once (the demo model on the standard-library code prompts of
spec_bench.py, float32, on any device), then replays every request alone through the engine's
own Scheduler and NgramProposer with those outputs standing in for the model. The counts (steps,
verify steps, proposals that found nothing, steps spent backing off, accepted lengths) are what
the engine would do; tokens per step carries over to the GPU, where a plain step of the demo
model costs about what a verify step does.

`--what-if-backoff A,B,C,D` also replays with the scheduler's back-off constants set to
(SPEC_BACKOFF_AFTER, SPEC_MAX_BACKOFF, SPEC_EMPTY_BACKOFF_AFTER, SPEC_EMPTY_MAX_BACKOFF)
(0 for an "after" turns that back-off off), to see what the back-off costs at batch 1.

Usage: python benchmarks/ngram_sweep.py --out PATH [--outputs CACHE.json] [--num-prompts N]
       [--output-len N] [--k 4,6,8] [--lookup-min 1,2,3] [--lookup-max 2,4,8]
       [--what-if-backoff 0,32,0,16]
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

BACKOFF_NAMES = ("SPEC_BACKOFF_AFTER", "SPEC_MAX_BACKOFF", "SPEC_EMPTY_BACKOFF_AFTER",
                 "SPEC_EMPTY_MAX_BACKOFF")


def greedy_outputs(model: str, prompts: list, output_len: int, **engine_args: Any
                   ) -> list[dict[str, list[int]]]:
    """Per prompt its token ids and the plain greedy output ids (ignore_eos)."""
    from peregrine import LLM, SamplingParams
    llm = LLM(model, seed=0, **engine_args)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=output_len,
                                                ignore_eos=True), use_tqdm=False)
    return [{"prompt": list(o.prompt_token_ids), "output": list(o.outputs[0].token_ids)}
            for o in outs]


@contextlib.contextmanager
def backoff_constants(values: tuple[int, int, int, int] | None) -> Iterator[None]:
    """The scheduler's back-off constants set to `values` inside the block (None: as they are)."""
    from peregrine.engine import spec_scheduling as scheduler
    old = tuple(getattr(scheduler, n) for n in BACKOFF_NAMES)
    if values is not None:
        after, most, empty_after, empty_most = values
        # NOTE: "after" 0 means never: a count that no request reaches.
        values = (after or 1 << 30, most, empty_after or 1 << 30, empty_most)
        for n, v in zip(BACKOFF_NAMES, values):
            setattr(scheduler, n, v)
    try:
        yield
    finally:
        for n, v in zip(BACKOFF_NAMES, old):
            setattr(scheduler, n, v)


def replay(requests: list[dict[str, list[int]]], k: int, lookup_min: int, lookup_max: int,
           max_model_len: int = 4096) -> dict[str, Any]:
    """Each request alone, one after another, through a Scheduler and the n-gram proposer, its
    recorded greedy output standing in for the model; the counts the engine would see."""
    from peregrine.config import CacheConfig, SchedulerConfig
    from peregrine.engine.request import Request
    from peregrine.engine.scheduler import Scheduler
    from peregrine.messages import ModelRunnerOutput
    from peregrine.sampling_params import SamplingParams
    from peregrine.spec_decode.config import SpeculativeConfig
    from peregrine.spec_decode.ngram import ngram_propose
    spec = SpeculativeConfig("ngram", k, lookup_max, lookup_min, disable_by_batch_size=None)
    sc = SchedulerConfig(1, max_model_len, max_model_len, True, "fcfs", None, "recompute")
    block = 16
    sched = Scheduler(sc, CacheConfig(block, 0.9, 1.0, None, False),
                      len(requests) * (max_model_len // block + 2), spec)
    steps = verify = proposals = empty = skipped = 0
    accepted_lengths: Counter[int] = Counter()
    for i, r in enumerate(requests):
        prompt, output = r["prompt"], r["output"]
        n_out = len(output)
        if len(prompt) + n_out + k + 1 > max_model_len:
            raise ValueError(f"request {i}: {len(prompt)} + {n_out} tokens do not fit "
                             f"max_model_len {max_model_len}")
        rid = f"r{i}"
        req = Request(rid, list(prompt), SamplingParams(max_tokens=n_out, ignore_eos=True),
                      arrival_time=0.0, eos_token_ids=(), max_tokens=n_out)
        sched.add_request(req)
        while sched.has_unfinished_requests():
            out = sched.schedule()
            steps += 1
            if rid not in out.num_scheduled_tokens:
                raise RuntimeError(f"request {i} was not scheduled at step {steps}")
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            done = req.num_output_tokens
            sampled = []
            if req.num_computed_tokens + out.num_scheduled_tokens[rid] - len(drafts) \
                    >= req.num_tokens:
                n = 0
                while n < len(drafts) and drafts[n] == output[done + n]:
                    n += 1
                sampled = output[done:done + n + 1]
                if drafts:
                    verify += 1
                    accepted_lengths[n] += 1
            proposed: dict[str, list[int]] = {}
            if out.propose_drafts and sampled and rid not in out.no_propose_req_ids:
                history = np.array([*prompt, *output[:done + len(sampled)]])  # (N,)
                # NOTE: the runner's cap: the next step emits at most max_tokens in all.
                num_d = min(k, n_out - (done + len(sampled)) - 1)
                if num_d > 0:
                    proposals += 1
                    d = ngram_propose(history, num_d, lookup_min, lookup_max).tolist()
                    empty += not d
                    if d:
                        proposed[rid] = d
            elif sampled and rid in out.no_propose_req_ids:
                skipped += 1
            sched.update_from_output(out, ModelRunnerOutput([rid], [sampled], {}, {}, proposed))
    num_tokens = sum(len(r["output"]) for r in requests)
    drafted = sched.spec_num_draft_tokens
    acc = sched.spec_num_accepted_tokens
    return {"k": k, "lookup_min": lookup_min, "lookup_max": lookup_max, "steps": steps,
            "tokens_per_step": num_tokens / steps, "verify_steps": verify,
            "empty_proposals": empty, "proposals": proposals,
            "backing_off_steps": skipped,
            "acceptance_rate": acc / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + acc / verify if verify else 0.0,
            "accepted_lengths": dict(sorted(accepted_lengths.items()))}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="write the results as JSON here")
    p.add_argument("--outputs", help="cache of the greedy outputs (read if present, else written)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--k", default="4,6,8")
    p.add_argument("--lookup-min", default="1,2,3")
    p.add_argument("--lookup-max", default="2,3,4,5,8")
    p.add_argument("--what-if-backoff", action="append", default=[],
                   help="A,B,C,D: replay also with these back-off constants (repeatable)")
    p.add_argument("--device", default=None, help="where the model runs (default: the engine's)")
    ns = p.parse_args(argv)
    what_ifs = []
    for text in ns.what_if_backoff:
        v = _ints(text)
        if len(v) != 4 or min(v) < 0:
            p.error(f"--what-if-backoff {text!r}: expected four integers >= 0")
        what_ifs.append(tuple(v))
    ks, mins, maxs = _ints(ns.k), _ints(ns.lookup_min), _ints(ns.lookup_max)
    if not ks or min(ks) < 1 or not mins or min(mins) < 1 or not maxs:
        p.error("--k and --lookup-min need integers >= 1, --lookup-max at least one")
    cache = Path(ns.outputs) if ns.outputs else None
    if cache is not None and cache.exists():
        requests = json.loads(cache.read_text())
    else:
        from peregrine import demo
        from spec_bench import code_prompts
        extra = {"device": ns.device} if ns.device else {}
        requests = greedy_outputs(str(demo.demo_model_path()), code_prompts(ns.num_prompts),
                                  ns.output_len, dtype="float32", max_model_len=512, **extra)
        if cache is not None:
            cache.write_text(json.dumps(requests))
    rows = []
    for backoff in [None, *what_ifs]:
        with backoff_constants(backoff):
            for k, lo, hi in itertools.product(ks, mins, maxs):
                if hi < lo:
                    continue
                row = replay(requests, k, lo, hi)
                row["backoff"] = list(backoff) if backoff else "default"
                rows.append(row)
                print(f"backoff {row['backoff']!s:>14} k {k} min {lo} max {hi}: "
                      f"{row['tokens_per_step']:.2f} tokens/step, {row['verify_steps']} verify "
                      f"of {row['steps']} steps, {row['empty_proposals']} empty proposals, "
                      f"{row['backing_off_steps']} backing off, acceptance "
                      f"{row['acceptance_rate']:.2f}, mean length "
                      f"{row['mean_acceptance_length']:.2f}", flush=True)
    Path(ns.out).write_text(json.dumps({"num_requests": len(requests), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
