"""What the server's preprocessing thread pool costs or saves: the same W3-style load of text
prompts through the real HTTP server, with every tokenization in the pool and every one inline
on the event loop (as shipped, inputs up to a few thousand characters run inline and larger ones
in the pool, so W3's prompts take the inline path).

    python benchmarks/pool_cost.py --json /tmp/pool-cost.json -- --max-num-seqs 1024
    python benchmarks/pool_cost.py --json out.json --num-prompts 8 --input-len 32 \
        --output-len 8 --rates inf 16 -- --max-model-len 256      # a CPU smoke run

One `peregrine serve` of the demo model (it has a real tokenizer) starts in a subprocess with the
arguments after `--`; its ServingContext's executor (where `encode` and chat templates run) is
switched between the server's pool and an inline executor (the call runs at once, on the event
loop) through a route only this script adds. Prompts are windows of ~input-len tokens of Python
standard library source, decoded to text, so the server tokenizes every one. For each rate the
same requests run once per mode, pool first; each mode is warmed up once before the first rate.

Reports output tok/s, TTFT p50 / p99, TPOT p50 per mode and the inline - pool delta, plus the
server's preprocessing calls: how many, their mean run time and (pool) their mean queue wait.
Writes everything as JSON to --json.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import local_server  # noqa: E402

MODES = ("pool", "inline")
_ROUTE = "/bench/preprocess"  # added by this script's server only
_SOURCE_FILES = ("textwrap.py", "csv.py", "argparse.py", "dataclasses.py")  # ~70k tokens


# ------------------------------------------------------------------ the server side
class InlineExecutor(concurrent.futures.Executor):
    """Runs each submitted call at once in the submitting thread (the event loop's)."""

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting handler
            future.set_exception(e)
        return future


class TimedExecutor(concurrent.futures.Executor):
    """Wraps an executor: counts its calls, their run time and their wait from submit to start."""

    def __init__(self, inner: concurrent.futures.Executor) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.calls, self.run_s, self.wait_s = 0, 0.0, 0.0

    def stats(self) -> dict[str, float]:
        with self._lock:
            n = max(self.calls, 1)
            return {"calls": self.calls, "run_ms_mean": 1e3 * self.run_s / n,
                    "wait_ms_mean": 1e3 * self.wait_s / n, "run_s_total": self.run_s}

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        submitted = time.perf_counter()

        def timed():
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                with self._lock:
                    self.calls += 1
                    self.run_s += end - start
                    self.wait_s += start - submitted

        return self.inner.submit(timed)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.inner.shutdown(wait=wait, cancel_futures=cancel_futures)


def serve(argv: list[str]) -> int:
    """`peregrine serve ARGV` whose app also answers GET /bench/preprocess?mode=pool|inline
    (switch, then report the mode and the preprocessing stats since the last switch)."""
    from peregrine.entrypoints.openai import api_server
    from peregrine.entrypoints.openai.errors import bad_request
    from peregrine.entrypoints.serve import serve_main

    shipped = api_server.build_app

    def build_app(engine, args=None):
        app = shipped(engine, args)
        ctx = app.state.ctx
        executors = {"pool": TimedExecutor(ctx.executor), "inline": TimedExecutor(InlineExecutor())}
        ctx.executor = executors["pool"]
        # NOTE: every call through the executor of the mode, short inputs too (as shipped they run
        # inline: the "inline" rows), so "pool" is the cost of sending all of them to the pool.
        ctx.inline_max_chars = -1

        # NOTE: async, so the switch happens on the event loop, between handlers' steps.
        async def switch(mode: str | None = None) -> dict[str, Any]:
            current = next(m for m, e in executors.items() if e is ctx.executor)
            stats = ctx.executor.stats()
            if mode is not None:
                if mode not in executors:
                    raise bad_request(f"mode must be one of {MODES}, got {mode!r}", "mode")
                ctx.executor = executors[mode]
                ctx.executor.reset()
            return {"mode": mode or current, "previous": current, "stats": stats}

        app.add_api_route(_ROUTE, switch, methods=["GET"])
        return app

    api_server.build_app = build_app
    return serve_main(argv)


# ------------------------------------------------------------------ the client side
@dataclass(frozen=True)
class TextRequest:
    """A text prompt (the server tokenizes it), its length in tokens, and the tokens to generate."""

    prompt: str
    prompt_len: int
    output_len: int


def text_requests(tokenizer, num: int, input_len: int, output_len: int, ratio: float,
                  seed: int, files: tuple[str, ...] = _SOURCE_FILES) -> list[TextRequest]:
    """`num` windows of Python source, input_len tokens each (+-ratio), decoded to text, at
    distinct offsets (no shared prefix); outputs of output_len (+-ratio) tokens."""
    if num < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num-prompts, input-len and output-len must be >= 1")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {ratio}")
    from peregrine.demo.corpus import stdlib_root
    root = stdlib_root()
    text = "\n".join((root / name).read_text() for name in files if (root / name).exists())
    ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)
    in_lo, in_hi = max(1, round(input_len * (1 - ratio))), round(input_len * (1 + ratio))
    out_lo, out_hi = max(1, round(output_len * (1 - ratio))), round(output_len * (1 + ratio))
    room = len(ids) - in_hi
    if room < num:
        raise ValueError(f"the source text has {len(ids)} tokens: too few for {num} prompts of "
                         f"up to {in_hi} tokens at distinct offsets")
    rng = random.Random(seed)
    out = []
    for start in rng.sample(range(room), num):
        n = rng.randint(in_lo, in_hi)
        out.append(TextRequest(tokenizer.decode(ids[start:start + n]), n,
                               rng.randint(out_lo, out_hi)))
    return out


def _get(url: str, timeout: float = 10.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def start_server(serve_args: list[str], log_path: str, timeout: float) -> tuple[subprocess.Popen, str]:
    """This script's server on a free local port; (process, base url) once healthy."""
    return local_server.start_server([sys.executable, str(Path(__file__).resolve()), "--serve",
                                      *serve_args], log_path, timeout, signal.SIGINT)


def stop_server(proc: subprocess.Popen) -> None:
    local_server.stop_server(proc, signal.SIGINT)


def _rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _row(summary: dict[str, Any]) -> dict[str, float]:
    return {"output_tok_s": summary["output_throughput"],
            "ttft_p50_ms": summary["ttft_ms"]["median"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "tpot_p50_ms": summary["tpot_ms"]["median"],
            "successful": summary["successful_requests"], "failed": summary["failed_requests"],
            "duration_s": summary["duration_s"]}


def delta(pool: dict[str, float], inline: dict[str, float]) -> dict[str, float]:
    """inline - pool for each measure, and inline / pool - 1 in percent."""
    out: dict[str, float] = {}
    for key in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms"):
        out[key] = inline[key] - pool[key]
        out[key + "_pct"] = 100.0 * (inline[key] / pool[key] - 1.0) if pool[key] else math.nan
    return out


def run(ns: argparse.Namespace, serve_args: list[str]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from peregrine.bench.serve import run_benchmark
    from peregrine.demo import demo_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_path()), local_files_only=True)
    reqs = text_requests(tokenizer, ns.num_prompts, ns.input_len, ns.output_len,
                         ns.range_ratio, ns.seed)
    warm = text_requests(tokenizer, ns.warmup_prompts, ns.input_len, ns.output_len,
                         ns.range_ratio, ns.seed + 1)
    log_path = ns.server_log or os.path.splitext(ns.json)[0] + "-server.log"
    proc, url = start_server(serve_args, log_path, ns.server_timeout)
    config = dict(vars(ns), rates=[_rate_name(r) for r in ns.rates])
    result: dict[str, Any] = {"config": config,
                              "serve_args": serve_args, "rates": {}}
    try:
        for mode in MODES:  # NOTE: warm each path (graphs, allocator, pool threads) before timing
            _get(f"{url}{_ROUTE}?mode={mode}")
            asyncio.run(run_benchmark(url, None, warm, seed=ns.seed))
        for rate in ns.rates:
            per_mode: dict[str, Any] = {}
            for mode in MODES:
                _get(f"{url}{_ROUTE}?mode={mode}")
                num = len(reqs) if math.isinf(rate) else min(len(reqs), ns.finite_prompts)
                summary, _ = asyncio.run(run_benchmark(url, None, reqs[:num], request_rate=rate,
                                                       seed=ns.seed))
                stats = _get(f"{url}{_ROUTE}")["stats"]
                per_mode[mode] = dict(_row(summary), preprocess=stats, requests=num)
                print(f"rate {rate:g} {mode:>6}: {per_mode[mode]['output_tok_s']:9.1f} tok/s  "
                      f"TTFT p50 {per_mode[mode]['ttft_p50_ms']:8.2f} p99 "
                      f"{per_mode[mode]['ttft_p99_ms']:8.2f} ms  TPOT p50 "
                      f"{per_mode[mode]['tpot_p50_ms']:7.3f} ms  preprocess "
                      f"{stats['calls']} calls, run {stats['run_ms_mean']:.3f} ms, wait "
                      f"{stats['wait_ms_mean']:.3f} ms", flush=True)
            per_mode["delta_inline_minus_pool"] = delta(per_mode["pool"], per_mode["inline"])
            result["rates"][_rate_name(rate)] = per_mode
    finally:
        stop_server(proc)
    return result


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--finite-prompts", type=int, default=1000,
                   help="requests per finite-rate run (at most --num-prompts)")
    p.add_argument("--warmup-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=180)
    p.add_argument("--range-ratio", type=float, default=0.1)
    p.add_argument("--rates", type=float, nargs="+", default=[math.inf, 16.0],
                   help="requests per second (inf: all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-timeout", type=float, default=900.0)
    p.add_argument("--server-log", default=None, help="default: next to --json")
    ns = p.parse_args(argv)
    if any(not r > 0 for r in ns.rates):
        p.error("--rates must be > 0 (inf for all at once)")
    if ns.finite_prompts < 1 or ns.warmup_prompts < 1:
        p.error("--finite-prompts and --warmup-prompts must be >= 1")
    return ns, serve_args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns, serve_args = parse_args(argv)
    result = run(ns, serve_args)
    with open(ns.json, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"wrote {ns.json}")
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2:]))
    main()
