"""Speculative decoding on the GPU: latency at batch 1 with and without speculation (same process),
acceptance, the draft's cost per step, the speedup predicted from those next to the measured one,
and a batch-size sweep that shows where speculation stops paying (disable_by_batch_size).

Cases (greedy unless said, ignore_eos, bf16, CUDA graphs):
- ngram-code: n-gram proposer on the demo model, prompts cut from Python's standard library;
- ngram-random: n-gram on random token prompts (drawn from 64 token ids, so the prompt itself
  offers matches), Llama-3-8B's shape with dummy weights, sampled at temperature 1 (seeded): the
  nothing-accepted case, whose slowdown (the proposer's search, rejected verify steps, then the
  back-off) must stay within 3% (`slowdown_ok`);
- draft-demo: the demo draft on the demo model (needs the draft-model proposer);
- demo-self-rtn, demo-self-fp8: the demo model drafted by its own weights quantized online
  (4-bit RTN, FP8), on the code prompts: a trained model, so acceptance means something;
- self-rtn, self-fp8: Llama-3-8B's shape, dummy weights, drafted by its own weights quantized
  online (needs the draft-model proposer); random weights accept almost nothing, so these
  measure the draft's cost.

The n-gram cases take k and prompt_lookup_min / max from the command line; the draft cases take
k. For the demo-model cases `--fp32` also runs batch 1 in float32 (no sweep) and reports
`same_tokens_as_plain_fp32`, which must be 1.0: in bf16 a verify step of k + 1 tokens and k + 1
steps of one token may round near-ties apart, in float32 they may not.

Predicted speedup = tokens per step x t_plain / (t_plain + t_propose): what speculation gives if
a verify step of k + 1 tokens costs what a plain step of one costs (true while decoding is bound
by reading the weights) and proposing costs t_propose; the gap to the measured speedup is the
verify step's extra cost. Speculative steps run synchronously (a verify step's tokens decide the
next step), while plain decoding overlaps each step's host work with the GPU, so each case also
times plain batch-1 decoding with asynchronous scheduling off (t_plain_sync) and reports
predicted_speedup_sync = tokens per step x t_plain / (t_plain_sync + t_propose): the same model
with a verify step costing a synchronous plain step, which is what a host-bound model (the demo
model at ~1,400 tok/s) pays.

Usage: python benchmarks/spec_bench.py --out PATH [--cases ngram-code,ngram-random,...]
       [--output-len N] [--batches 1,4,16,64] [-k K] [--lookup-min N] [--lookup-max N]
       [--draft-k K] [--fp32]
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG_8B = ROOT / "benchmarks" / "configs" / "llama-3-8b.json"
CASES = ("ngram-code", "ngram-random", "draft-demo", "demo-self-rtn", "demo-self-fp8",
         "self-rtn", "self-fp8")
DEMO_CASES = ("ngram-code", "draft-demo", "demo-self-rtn", "demo-self-fp8")
STDLIB_MODULES = ("textwrap", "json.encoder", "argparse", "csv", "shlex", "fractions",
                  "heapq", "bisect", "calendar", "string", "glob", "fnmatch")
MAX_SLOWDOWN = 0.03
# The n-gram settings with the most tokens per step at batch 1 on the code prompts (replayed for
# many settings by benchmarks/ngram_sweep.py), and the draft models' k.
DEFAULT_NGRAM_K = 8
DEFAULT_LOOKUP_MIN = 1
DEFAULT_LOOKUP_MAX = 4
DEFAULT_DRAFT_K = 4


def code_prompts(n: int, chars: int = 600) -> list[str]:
    """`n` snippets of standard-library source, each cut at a `def` and ending mid-function."""
    import importlib
    prompts = []
    for name in STDLIB_MODULES:
        src = inspect.getsource(importlib.import_module(name))
        starts = [i for i in range(len(src)) if src.startswith("\ndef ", i)
                  or src.startswith("\n    def ", i)]
        for s in starts[1::3]:
            prompts.append(src[s + 1:s + 1 + chars])
            if len(prompts) == n:
                return prompts
    return prompts


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts over 64 random token ids of the vocabulary."""
    rng = random.Random(seed)
    alphabet = rng.sample(range(1000, vocab), 64)
    return [[rng.choice(alphabet) for _ in range(length)] for _ in range(n)]


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def draft_model_available() -> str | None:
    """None when the draft-model proposer exists, else why not."""
    from peregrine.spec_decode import get_proposer_class
    try:
        get_proposer_class("draft_model")
    except ValueError as e:
        return str(e)
    return None


class Bench:
    """One engine: batch-1 latency over the prompts, then the batch sweep."""

    def __init__(self, model: str, spec: dict | None, temperature: float = 0.0,
                 **engine_args: Any) -> None:
        from peregrine.engine.llm_engine import LLMEngine
        from peregrine.config import EngineArgs
        if spec is not None:
            spec = {**spec, "disable_by_batch_size": None}  # the sweep measures every size
        self.engine = LLMEngine.from_engine_args(EngineArgs(
            model=model, speculative_config=spec, seed=0, **engine_args))
        self.core = self.engine.core_client.core
        self.runner = self.core.executor.worker.model_runner
        self.spec = spec is not None
        self.temperature = temperature

    def close(self) -> None:
        import torch
        del self.engine, self.runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _generate(self, prompts: list, output_len: int) -> tuple[list[list[int]], float, float]:
        """(tokens per request, seconds to the first token of all, seconds after it)."""
        from peregrine import SamplingParams
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=self.temperature, seed=i, max_tokens=output_len,
                                    ignore_eos=True)
            self.engine.add_request(f"b{time.perf_counter_ns()}-{i:04d}", p, params)
        _sync()
        t0 = time.perf_counter()
        first = None
        tokens: dict[str, list[int]] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
        _sync()
        end = time.perf_counter()
        return [tokens[k] for k in sorted(tokens)], first - t0, end - first

    def latency(self, prompts: list, output_len: int) -> dict[str, Any]:
        from peregrine.bench.offline import spec_decode_report
        self._generate(prompts[:1], 16)  # warm-up
        tm = self.runner.timing
        phases0 = {**{f"core_{k}": v for k, v in self.core.timing.items()}, **tm}
        before, steps0, propose0 = self.engine.get_stats(), tm["steps"], tm.get("propose", 0.0)
        verify0, vgraph0 = tm.get("verify_steps", 0), tm.get("verify_graph_steps", 0)
        decode_s, outs = 0.0, []
        for p in prompts:
            toks, _, dec = self._generate([p], output_len)
            decode_s += dec
            outs.append(toks[0])
        steps = tm["steps"] - steps0
        tokens = len(prompts) * (output_len - 1)
        res = {"tokens_per_s": tokens / decode_s, "decode_s": decode_s,
               "tokens_per_step": len(prompts) * output_len / max(steps, 1),
               "propose_ms_per_step": (tm.get("propose", 0.0) - propose0) / max(steps, 1) * 1e3,
               "verify_steps": tm.get("verify_steps", 0) - verify0,
               "verify_graph_steps": tm.get("verify_graph_steps", 0) - vgraph0,
               "host_ms_per_step": _phases_ms(phases0, {**{f"core_{k}": v for k, v in
                                                          self.core.timing.items()}, **tm},
                                              steps),
               "tokens": outs}
        if self.spec:
            res.update(spec_decode_report(before, self.engine.get_stats()))
        return res

    def sweep(self, prompts: list, output_len: int, batches: list[int]) -> dict[int, float]:
        out = {}
        for b in batches:
            batch = [prompts[i % len(prompts)] for i in range(b)]
            _, _, dec = self._generate(batch, output_len)
            out[b] = b * (output_len - 1) / dec
        return out


def _phases_ms(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """Milliseconds per step of each timed phase (the engine core's as core_*, the model
    runner's: prepare, forward_launch, sample_launch, wait for the device, propose)."""
    skip = {"steps", "decode_only_steps", "verify_steps", "verify_graph_steps",
            "piecewise_graph_steps"}
    return {k: (v - before.get(k, 0.0)) / max(steps, 1) * 1e3 for k, v in after.items()
            if k not in skip and v != before.get(k, 0.0)}


_PLAIN: dict[tuple, dict[str, Any]] = {}  # plain runs shared by cases on the same model


def case_spec(case: str, ns: argparse.Namespace, model: str) -> dict[str, Any]:
    """The case's speculative_config, from the command line's settings."""
    from peregrine import demo
    if case.startswith("ngram"):
        return {"method": "ngram", "num_speculative_tokens": ns.k,
                "prompt_lookup_max": ns.lookup_max, "prompt_lookup_min": ns.lookup_min}
    if case == "draft-demo":
        return {"model": str(demo.demo_draft_path()), "num_speculative_tokens": ns.draft_k}
    return {"model": model, "quantization": case.rsplit("-", 1)[1],
            "num_speculative_tokens": ns.draft_k}


def _plain_then_spec(key: tuple, model: str, spec: dict, prompts: list, ns: argparse.Namespace,
                     temperature: float, batches: list[int], engine_args: dict[str, Any]
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Batch-1 latency and the sweep without speculation (shared under `key`), then with it."""
    out = []
    for s in (None, spec):
        if s is None and key in _PLAIN:
            out.append(dict(_PLAIN[key]))
            continue
        b = Bench(model, s, temperature, **engine_args)
        try:
            res = b.latency(prompts, ns.output_len)
            res["sweep_tokens_per_s"] = b.sweep(prompts, ns.output_len, batches)
        finally:
            b.close()
        if s is None:
            _PLAIN[key] = dict(res)
        out.append(res)
    return out[0], out[1]


def _plain_sync(key: tuple, model: str, prompts: list, ns: argparse.Namespace,
                temperature: float, engine_args: dict[str, Any]) -> dict[str, Any]:
    """Batch-1 latency without speculation and with asynchronous scheduling off (shared under
    `key` like the plain run)."""
    if ("sync", *key) not in _PLAIN:
        b = Bench(model, None, temperature, **engine_args)
        try:
            res = b.latency(prompts, ns.output_len)
        finally:
            b.close()
        res.pop("tokens")
        _PLAIN["sync", *key] = res
    return dict(_PLAIN["sync", *key])


def _same_tokens(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def run_case(case: str, ns: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """One case's results; `overrides` go to the engines (the CPU smoke test's device)."""
    from peregrine import demo
    from peregrine.entrypoints.model_path import model_folder
    on_demo = case in DEMO_CASES
    if on_demo:
        model, prompts = str(demo.demo_model_path()), code_prompts(ns.num_prompts)
        engine_args: dict[str, Any] = dict(dtype="bfloat16", max_model_len=512)
    else:
        model = model_folder(str(CONFIG_8B))
        prompts = random_prompts(ns.num_prompts, 128, 128256)
        engine_args = dict(dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
                           max_model_len=1024)
    spec = case_spec(case, ns, model)
    # NOTE: graphs only for what the run uses, so that engines start quickly.
    engine_args.update(max_num_seqs=max(ns.batches), max_prefill_graph_tokens=512)
    engine_args.update(overrides)
    if not case.startswith("ngram"):
        why = draft_model_available()
        if why is not None:
            return {"skipped": f"the draft-model proposer is not available: {why}"}
    result: dict[str, Any] = {"model": "demo" if on_demo else model, "spec_config": spec}
    temperature = 1.0 if case == "ngram-random" else 0.0
    key = (on_demo, temperature, ns.output_len, ns.num_prompts, tuple(ns.batches),
           tuple(sorted(overrides.items())))
    plain, sp = _plain_then_spec(key, model, spec, prompts, ns, temperature, ns.batches,
                                 engine_args)
    result["plain"], result["spec"] = plain, sp
    t_plain = 1.0 / plain["tokens_per_s"]
    t_prop = sp["propose_ms_per_step"] / 1e3
    result["measured_speedup"] = sp["tokens_per_s"] / plain["tokens_per_s"]
    result["predicted_speedup"] = sp["tokens_per_step"] * t_plain / (t_plain + t_prop)
    sync = _plain_sync(key, model, prompts, ns, temperature,
                       {**engine_args, "max_num_seqs": 1, "async_scheduling": False})
    result["plain_sync_tokens_per_s"] = sync["tokens_per_s"]
    result["plain_sync_host_ms_per_step"] = sync.get("host_ms_per_step", {})
    result["predicted_speedup_sync"] = (sp["tokens_per_step"] * t_plain
                                        / (1.0 / sync["tokens_per_s"] + t_prop))
    result["same_tokens_as_plain"] = _same_tokens(plain.pop("tokens"), sp.pop("tokens"))
    result["sweep_speedup"] = {b: sp["sweep_tokens_per_s"][b] / plain["sweep_tokens_per_s"][b]
                               for b in ns.batches}
    paying = [b for b in ns.batches if result["sweep_speedup"][b] > 1.0]
    result["largest_batch_that_pays"] = max(paying) if paying else 0
    if case == "ngram-random":
        result["slowdown"] = 1.0 - result["measured_speedup"]
        result["slowdown_ok"] = result["slowdown"] <= MAX_SLOWDOWN
    if ns.fp32 and on_demo:
        # NOTE: batch 1 only (no sweep): float32 makes verify and plain steps agree exactly.
        args32 = {**engine_args, "dtype": "float32", "max_num_seqs": 1}
        p32, s32 = _plain_then_spec(("fp32", *key), model, spec, prompts, ns, temperature, [],
                                    args32)
        result["same_tokens_as_plain_fp32"] = _same_tokens(p32.pop("tokens"), s32.pop("tokens"))
        result["fp32"] = {"plain_tokens_per_s": p32["tokens_per_s"],
                          "spec_tokens_per_s": s32["tokens_per_s"],
                          "tokens_per_step": s32["tokens_per_step"],
                          "measured_speedup": s32["tokens_per_s"] / p32["tokens_per_s"]}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="write the results as JSON here")
    p.add_argument("--cases", default=",".join(CASES),
                   help="comma-separated, of: " + ", ".join(CASES))
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("-k", type=int, default=DEFAULT_NGRAM_K,
                   help="num_speculative_tokens of the n-gram cases")
    p.add_argument("--lookup-min", type=int, default=DEFAULT_LOOKUP_MIN,
                   help="prompt_lookup_min of the n-gram cases")
    p.add_argument("--lookup-max", type=int, default=DEFAULT_LOOKUP_MAX,
                   help="prompt_lookup_max of the n-gram cases")
    p.add_argument("--draft-k", type=int, default=DEFAULT_DRAFT_K,
                   help="num_speculative_tokens of the draft-model cases")
    p.add_argument("--fp32", action="store_true",
                   help="demo-model cases: also batch 1 in float32, same_tokens_as_plain_fp32")
    ns = p.parse_args(argv)
    ns.batches = [int(b) for b in ns.batches.split(",")]
    for name in ("k", "lookup_min", "draft_k"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    if ns.lookup_max < ns.lookup_min:
        p.error(f"--lookup-max {ns.lookup_max} is below --lookup-min {ns.lookup_min}")
    cases = ns.cases.split(",")
    bad = [c for c in cases if c not in CASES]
    if bad:
        p.error(f"unknown case(s) {', '.join(bad)} (known: {', '.join(CASES)})")
    import torch
    if not torch.cuda.is_available():
        print("spec_bench.py measures the GPU: CUDA is not available", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "k": ns.k,
                               "lookup_min": ns.lookup_min, "lookup_max": ns.lookup_max,
                               "draft_k": ns.draft_k,
                               "output_len": ns.output_len, "cases": {}}
    for case in cases:
        t0 = time.perf_counter()
        res = run_case(case, ns)
        res["wall_s"] = time.perf_counter() - t0
        results["cases"][case] = res
        Path(ns.out).write_text(json.dumps(results, indent=2))  # partial results survive
        if "skipped" in res:
            print(f"{case}: skipped ({res['skipped']})")
            continue
        print(f"{case}: plain {res['plain']['tokens_per_s']:.1f} tok/s, spec "
              f"{res['spec']['tokens_per_s']:.1f} tok/s (measured x{res['measured_speedup']:.2f}, "
              f"predicted x{res['predicted_speedup']:.2f}; plain synchronous "
              f"{res['plain_sync_tokens_per_s']:.1f} tok/s, predicted from it "
              f"x{res['predicted_speedup_sync']:.2f}), acceptance "
              f"{res['spec'].get('acceptance_rate', 0):.2f}, mean length "
              f"{res['spec'].get('mean_acceptance_length', 0):.2f}, tokens per step "
              f"{res['spec']['tokens_per_step']:.2f}, same tokens "
              f"{res['same_tokens_as_plain']:.2f}"
              + (f" (fp32 {res['same_tokens_as_plain_fp32']:.2f})" if "fp32" in res else "")
              + ", sweep " + ", ".join(f"{b}: x{s:.2f}" for b, s in res["sweep_speedup"].items()))
        for label, phases in (("plain", res["plain"]["host_ms_per_step"]),
                              ("plain sync", res["plain_sync_host_ms_per_step"]),
                              ("spec", res["spec"]["host_ms_per_step"])):
            print(f"  {label} host ms/step: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                          sorted(phases.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
