"""Async against synchronous scheduling on one offline batch, measured so that nothing but the
mode differs: where each mode's host time per step goes, and what one-time work a run paid.

    python benchmarks/async_probe.py --out /tmp/async-probe.json      # the demo model, 256 x 96
    python benchmarks/async_probe.py --model /path/to/hf-folder --num-prompts 256 --out out.json

Both engines (async_scheduling on and off) are built first and each is warmed up with the full
batch (the same prompts, fewer tokens), so graphs, Triton variants, the pinned-memory cache and
the allocator see every shape before any timing. The timed runs then alternate between the two
modes (on, off, off, on, ...) so drift lands on both. Each run records output tok/s, engine steps,
host milliseconds per step per phase (front end, core, runner), the Triton kernels compiled and
the garbage collections (full ones apart) during the run. A run that compiled anything is flagged:
its time includes a one-time cost.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class RunCounters:
    """Triton compiles and garbage collections while `active`."""

    def __init__(self) -> None:
        self.active = False
        self.compiles = 0
        self.collections = [0, 0, 0]  # per generation
        gc.callbacks.append(self._on_gc)
        self.compile_hook = self._install_compile_hook()

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if self.active and phase == "start":
            self.collections[info["generation"]] += 1

    def _install_compile_hook(self) -> bool:
        try:
            from triton import knobs
        except ImportError:
            return False
        if not hasattr(knobs.runtime, "jit_post_compile_hook"):
            return False
        previous = knobs.runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            if self.active:
                self.compiles += 1
            return previous(*args, **kwargs) if previous is not None else None

        knobs.runtime.jit_post_compile_hook = hook
        return True

    def start(self) -> None:
        self.compiles, self.collections, self.active = 0, [0, 0, 0], True

    def stop(self) -> dict[str, Any]:
        self.active = False
        return {"triton_compiles": self.compiles if self.compile_hook else None,
                "gc_collections": list(self.collections)}


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _snapshot(engine) -> dict[str, dict[str, float]]:
    from peregrine.bench.offline import host_timings
    return {part: dict(t) for part, t in host_timings(engine).items()}


def _per_step_ms(before: dict, after: dict, steps: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for part, t in after.items():
        out[part] = {k: round(1e3 * (v - before[part].get(k, 0.0)) / max(steps, 1), 4)
                     for k, v in t.items() if k not in ("steps", "decode_only_steps",
                                                         "verify_steps") and "graph_steps" not in k}
    return out


def timed_run(llm, prompts, params, counters: RunCounters) -> dict[str, Any]:
    """One generate() of the batch: tok/s, engine steps, host ms per step, compiles, GCs."""
    engine = llm.engine
    steps = [0]
    original = engine.step

    def counted():
        steps[0] += 1
        return original()

    engine.step = counted
    before = _snapshot(engine)
    _sync()
    counters.start()
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync()
    finally:
        seconds = time.perf_counter() - t0
        extra = counters.stop()
        engine.step = original
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "steps": steps[0],
            "host_ms_per_step": _per_step_ms(before, _snapshot(engine), steps[0]), **extra}


def run(ns: argparse.Namespace) -> dict[str, Any]:
    from peregrine import LLM, SamplingParams
    from peregrine.demo import demo_model_path

    counters = RunCounters()
    model = ns.model or str(demo_model_path())
    prompts = [f"# record {i}\nrecord = " for i in range(ns.num_prompts)]

    def params(max_tokens: int) -> list[SamplingParams]:
        return [SamplingParams(temperature=ns.temperature, seed=i, max_tokens=max_tokens,
                               ignore_eos=True) for i in range(ns.num_prompts)]

    extra = {}
    if ns.gpu_memory_utilization is not None:
        extra["gpu_memory_utilization"] = ns.gpu_memory_utilization
    llms = {}
    for mode in (True, False):
        llms[mode] = LLM(model, dtype=ns.dtype, max_model_len=ns.max_model_len,
                         async_scheduling=mode, **extra)
    warmup = {}
    for mode, llm in llms.items():
        counters.start()
        for _ in range(2):  # NOTE: the full batch: every shape the timed runs will meet
            llm.generate(prompts, params(ns.warmup_tokens), use_tqdm=False)
        warmup[str(mode)] = counters.stop()
    runs: dict[str, list[dict[str, Any]]] = {"async": [], "sync": []}
    order = []
    for r in range(ns.repeats):
        order += [True, False] if r % 2 == 0 else [False, True]
    for mode in order:
        res = timed_run(llms[mode], prompts, params(ns.max_tokens), counters)
        runs["async" if mode else "sync"].append(res)
        flag = "  (compiled during the run)" if res["triton_compiles"] else ""
        ph = res["host_ms_per_step"]
        print(f"async={str(mode):5} {res['tok_s']:9.0f} tok/s {res['steps']:4d} steps  ms/step: "
              f"engine {ph['engine'].get('step_total', 0):.3f} (core {ph['engine'].get('core', 0):.3f},"
              f" process {ph['engine'].get('process', 0):.3f})  runner wait "
              f"{ph['runner'].get('wait', 0):.3f}  gc {res['gc_collections']}{flag}", flush=True)
    summary = {}
    for name, rs in runs.items():
        summary[name] = {"tok_s_median": statistics.median(r["tok_s"] for r in rs),
                         "tok_s_max": max(r["tok_s"] for r in rs),
                         "runs_with_compiles": sum(1 for r in rs if r["triton_compiles"])}
    summary["async_over_sync"] = summary["async"]["tok_s_median"] / summary["sync"]["tok_s_median"]
    print(f"median tok/s: async {summary['async']['tok_s_median']:.0f}, sync "
          f"{summary['sync']['tok_s_median']:.0f} (async / sync {summary['async_over_sync']:.3f})")
    return {"config": vars(ns), "model": model, "warmup": warmup, "runs": runs, "summary": summary}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: the demo model)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="per engine (both live at once; the KV pool is capped at max_num_seqs "
                        "full-length sequences, so the default fits two small models)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    ns = p.parse_args(argv)
    if ns.num_prompts < 1 or ns.max_tokens < 1 or ns.warmup_tokens < 1 or ns.repeats < 1:
        p.error("--num-prompts, --max-tokens, --warmup-tokens and --repeats must be >= 1")
    return ns


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    result = run(ns)
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {ns.out}")
    return result


if __name__ == "__main__":
    main()
