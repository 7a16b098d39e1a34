"""Where does a prefix-cache hit's time to first token go? Engine only, no HTTP.

Builds an LLMEngine (default: Llama-3-8B architecture, dummy bf16 weights, prefix caching on),
then measures the time from add_request to the first token for a 2,100-token prompt whose first
2,000 tokens are cached ("hit") and for one that shares nothing ("miss"), with the engine idle and
with background requests decoding. For every probe it records each step's host phases from
LLMEngine.timing, so the TTFT splits into schedule / launch / wait / output work.

    python benchmarks/ttft_probe.py [--config benchmarks/configs/llama-3-8b.json] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from peregrine.bench.offline import host_timings, model_folder  # noqa: E402
from peregrine.config import EngineArgs  # noqa: E402
from peregrine.engine.llm_engine import LLMEngine  # noqa: E402
from peregrine.sampling_params import SamplingParams  # noqa: E402


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def _probe(engine: LLMEngine, rid: str, prompt: list[int]) -> dict:
    """Add one request and step until its first token; per-step host phases in ms."""
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    steps = []
    while True:
        timings = tuple(host_timings(engine).values())
        before = [dict(t) for t in timings]
        ts = time.perf_counter()
        outs = engine.step()
        te = time.perf_counter()
        phases = {k: round((t[k] - b.get(k, 0.0)) * (1 if "steps" in k else 1e3), 3)
                  for t, b in zip(timings, before) for k in t if t[k] != b.get(k, 0.0)}
        phases["wall"] = round((te - ts) * 1e3, 3)
        steps.append(phases)
        if any(o.request_id == rid and o.outputs[0].token_ids for o in outs):
            return {"ttft_ms": (te - t0) * 1e3, "steps": steps}
        if len(steps) > 50:
            raise RuntimeError("no first token after 50 steps")


def _print_compiled_variants() -> None:
    """How many compiled variants each Triton kernel has: more than one means a runtime value
    (an int argument, an alignment) picked a new specialisation, compiled on the request path."""
    import importlib
    for mod_name in ("decode_attention", "extend_attention", "rmsnorm", "rotary", "store_kv",
                     "activation", "sampling"):
        mod = importlib.import_module(f"peregrine.kernels.{mod_name}")
        for name, obj in vars(mod).items():
            caches = getattr(obj, "device_caches", None)
            if not caches:
                continue
            try:
                keys = [k for dev in caches.values() for k in dev[0]]
            except Exception:  # noqa: BLE001 - the cache layout differs across Triton versions
                continue
            print(f"compiled variants {mod_name}.{name}: {len(keys)}")
            for k in keys:
                print("   ", str(k)[:400])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(REPO / "benchmarks/configs/llama-3-8b.json"))
    p.add_argument("--prefix-len", type=int, default=2000)
    p.add_argument("--suffix-len", type=int, default=100)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--background", type=int, default=2, help="decoding requests in the busy case")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--out", default=None)
    p.add_argument("--cprofile", action="store_true",
                   help="also print a cProfile of the host work of 5 cache-hit prefill steps")
    ns = p.parse_args()
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model_folder(ns.config), load_format="dummy", dtype=ns.dtype,
        skip_tokenizer_init=True, max_model_len=ns.max_model_len, enable_prefix_caching=True,
        enforce_eager=ns.enforce_eager))
    rng = random.Random(0)
    vocab = min(120000, engine.config.model.vocab_size)
    prefix = _ids(rng, ns.prefix_len, vocab)
    # Warm-up: compile paths for long prefills and cache the shared prefix.
    for i in range(3):
        _probe(engine, f"warm{i}", prefix + _ids(rng, ns.suffix_len, vocab))
    while engine.has_unfinished_requests():
        engine.step()
    results: dict[str, list[dict]] = {}
    for busy in (False, True):
        if busy:
            for i in range(ns.background):
                engine.add_request(f"bg{i}", _ids(rng, 32, vocab),
                                   SamplingParams(max_tokens=ns.max_model_len - 32, ignore_eos=True))
            for _ in range(20):
                engine.step()
        for kind in ("hit", "miss"):
            runs = []
            for r in range(ns.reps):
                head = prefix if kind == "hit" else _ids(rng, ns.prefix_len, vocab)
                runs.append(_probe(engine, f"{kind}{busy}{r}", head + _ids(rng, ns.suffix_len, vocab)))
                for _ in range(3):
                    engine.step()
            results[f"{'busy' if busy else 'idle'}_{kind}"] = runs
        if busy:
            engine.abort_request([f"bg{i}" for i in range(ns.background)])
            while engine.has_unfinished_requests():
                engine.step()
    if ns.cprofile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        for r in range(5):
            engine.add_request(f"prof{r}", prefix + _ids(rng, ns.suffix_len, vocab),
                               SamplingParams(max_tokens=1, ignore_eos=True))
            prof.enable()
            engine.step()
            prof.disable()
            while engine.has_unfinished_requests():
                engine.step()
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
    _print_compiled_variants()
    summary = {}
    for name, runs in results.items():
        ttft = [r["ttft_ms"] for r in runs]
        summary[name] = {"ttft_ms_median": statistics.median(ttft), "ttft_ms_min": min(ttft),
                         "steps_of_median_run": sorted(runs, key=lambda r: r["ttft_ms"])[len(runs) // 2]["steps"]}
        print(f"{name:10s} TTFT median {statistics.median(ttft):7.2f} ms  min {min(ttft):7.2f} ms")
        for s in summary[name]["steps_of_median_run"]:
            print("    ", s)
    if ns.out:
        Path(ns.out).write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
