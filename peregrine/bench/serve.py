"""`peregrine bench serve`: stream requests through the OpenAI completions API with Poisson
arrivals and report throughput and TTFT / TPOT / ITL / end-to-end latency (mean, median, P99)."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from peregrine.bench.datasets import (DATASETS, BenchRequest, prefix_shared_dataset,
                                      random_dataset)
from peregrine.bench.http_client import Endpoint, HTTPError, get_json, post_sse, request


@dataclass
class RequestResult:
    """What one request measured (seconds; itl holds the gaps between streamed chunks)."""

    prompt_len: int
    output_len: int = 0
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    sent: float = 0.0  # perf_counter() when the request was sent


def detailed(results: list[RequestResult]) -> list[dict[str, Any]]:
    """One row per request (ms; sent_ms from the first request's send), for finding outliers."""
    start = min((r.sent for r in results), default=0.0)
    return [{"sent_ms": round((r.sent - start) * 1e3, 3), "prompt_len": r.prompt_len,
             "output_len": r.output_len, "success": r.success, "ttft_ms": round(r.ttft * 1e3, 3),
             "latency_ms": round(r.latency * 1e3, 3),
             "itl_ms": [round(x * 1e3, 3) for x in r.itl], "error": r.error} for r in results]


async def _one_request(ep: Endpoint, model: str, req: BenchRequest, headers: dict[str, str],
                       ignore_eos: bool) -> RequestResult:
    payload = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len,
               "temperature": 0.0, "stream": True, "ignore_eos": ignore_eos,
               "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res = RequestResult(prompt_len=req.prompt_len, sent=start)
    last = start
    chunks = 0
    try:
        async for data in post_sse(ep, "/v1/completions", payload, headers):
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                raise HTTPError(500, json.dumps(msg["error"]))
            now = time.perf_counter()
            if msg.get("choices"):
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                chunks += 1
                last = now
            if msg.get("usage"):
                res.output_len = msg["usage"]["completion_tokens"]
        res.latency = time.perf_counter() - start
        res.output_len = res.output_len or chunks
        res.success = chunks > 0
        if not res.success:
            res.error = "no tokens streamed"
    except (HTTPError, OSError, asyncio.IncompleteReadError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Poisson process: exponential gaps with mean 1/rate (all zero for an infinite rate)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(n)]


async def run_benchmark(base_url: str, model: str | None, requests: list[BenchRequest], *,
                        request_rate: float = math.inf, max_concurrency: int | None = None,
                        seed: int = 0, api_key: str | None = None,
                        ignore_eos: bool = True) -> tuple[dict[str, Any], list[RequestResult]]:
    """Send every request (arrivals at request_rate/s) and summarise; returns (summary, results)."""
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0 (inf for all at once), got {request_rate}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max concurrency must be >= 1, got {max_concurrency}")
    ep = Endpoint.parse(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if model is None:
        model = (await get_json(ep, "/v1/models", headers))["data"][0]["id"]
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(req: BenchRequest) -> RequestResult:
        if gate is None:
            return await _one_request(ep, model, req, headers, ignore_eos)
        async with gate:
            return await _one_request(ep, model, req, headers, ignore_eos)

    before = await _scrape(ep, headers)
    tasks = []
    start = time.perf_counter()
    for req, gap in zip(requests, _arrival_gaps(len(requests), request_rate, seed)):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(limited(req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    summary = summarize(results, duration)
    summary.update(model=model, request_rate=request_rate, max_concurrency=max_concurrency)
    # NOTE: the server's clock starts when its handler has parsed the request and stops when
    # the engine hands over the first token; the client's TTFT adds HTTP and the event loop.
    summary["server"] = server_means(before, await _scrape(ep, headers))
    return summary, list(results)


# Server-side latency histograms whose mean over the run is reported beside the client's view.
SERVER_HISTOGRAMS = ("time_to_first_token", "request_queue_time", "request_prefill_time",
                     "request_decode_time")


async def _scrape(ep: Endpoint, headers: dict[str, str]) -> dict[str, float] | None:
    """The peregrine_* histograms' _sum and _count samples from /metrics (None if unavailable)."""
    try:
        text = b"".join([c async for c in request(ep, "GET", "/metrics", None, headers)]).decode()
    except (HTTPError, OSError):
        return None
    got: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        base = name.split("{", 1)[0]
        if base.startswith("peregrine_") and base.endswith(("_sum", "_count")):
            try:
                got[base] = got.get(base, 0.0) + float(value)
            except ValueError:
                continue
    return got


def server_means(before: dict[str, float] | None,
                 after: dict[str, float] | None) -> dict[str, float | None]:
    """Mean of each server histogram over the run, in ms (None where it saw no sample)."""
    out: dict[str, float | None] = {}
    for h in SERVER_HISTOGRAMS:
        key = f"peregrine_{h}_seconds"
        n = total = 0.0
        if before is not None and after is not None:
            n = after.get(key + "_count", 0.0) - before.get(key + "_count", 0.0)
            total = after.get(key + "_sum", 0.0) - before.get(key + "_sum", 0.0)
        out[f"{h}_mean_ms"] = 1e3 * total / n if n else None
    return out


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    # NOTE: nearest-rank P99 (no interpolation), so it is always an observed value.
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean": statistics.fmean(values) * scale, "median": statistics.median(values) * scale,
            "p99": p99 * scale}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Throughput and latency (milliseconds) over the successful requests."""
    ok = [r for r in results if r.success]
    in_tok = sum(r.prompt_len for r in ok)
    out_tok = sum(r.output_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    errors = sorted({r.error for r in results if not r.success})
    return {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "duration_s": duration, "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration, "output_throughput": out_tok / duration,
        "total_token_throughput": (in_tok + out_tok) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([g for r in ok for g in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]), "errors": errors[:10],
    }


def format_summary(s: dict[str, Any]) -> str:
    """A human-readable table of the summary."""
    lines = [f"{'Successful requests:':<34}{s['successful_requests']}",
             f"{'Failed requests:':<34}{s['failed_requests']}",
             f"{'Benchmark duration (s):':<34}{s['duration_s']:.2f}",
             f"{'Total input tokens:':<34}{s['total_input_tokens']}",
             f"{'Total output tokens:':<34}{s['total_output_tokens']}",
             f"{'Request throughput (req/s):':<34}{s['request_throughput']:.2f}",
             f"{'Output token throughput (tok/s):':<34}{s['output_throughput']:.1f}",
             f"{'Total token throughput (tok/s):':<34}{s['total_token_throughput']:.1f}"]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                      ("e2el_ms", "E2E latency")):
        v = s[key]
        lines.append(f"{name + ' (ms) mean/median/P99:':<34}"
                     f"{v['mean']:.2f} / {v['median']:.2f} / {v['p99']:.2f}")
    server = s.get("server") or {}
    if any(v is not None for v in server.values()):
        vals = [server.get(f"{h}_mean_ms") for h in SERVER_HISTOGRAMS]
        lines.append(f"{'Server means (ms) TTFT/queue/prefill/decode:':<34} "
                     + " / ".join("-" if v is None else f"{v:.2f}" for v in vals))
    for err in s.get("errors", []):
        lines.append(f"error: {err}")
    return "\n".join(lines)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The flags of `peregrine bench serve`."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server's address (default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="model name sent with each request (default: the first id from "
                   "/v1/models)")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' (default: %(default)s)")
    p.add_argument("--dataset", choices=DATASETS, default="random",
                   help="random: random lengths; prefix-shared: one shared prefix, unique "
                   "suffixes (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=1000,
                   help="requests to send (default: %(default)s)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s with Poisson arrivals; inf sends all at once "
                   "(default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: %(default)s, no limit)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompts and the arrival times (default: %(default)s)")
    p.add_argument("--random-input-len", type=int, default=200,
                   help="random: mean prompt tokens (default: %(default)s)")
    p.add_argument("--random-output-len", type=int, default=180,
                   help="random: mean output tokens (default: %(default)s)")
    p.add_argument("--random-range-ratio", type=float, default=0.1,
                   help="random: lengths uniform in [L*(1-r), L*(1+r)] (default: %(default)s)")
    p.add_argument("--prefix-len", type=int, default=2000,
                   help="prefix-shared: shared tokens (default: %(default)s)")
    p.add_argument("--suffix-len", type=int, default=100,
                   help="prefix-shared: unique tokens per request (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=180,
                   help="prefix-shared: output tokens (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids are drawn from [--min-token-id, vocab-size) (default: "
                   "the served model's vocabulary size, asked from the server)")
    p.add_argument("--min-token-id", type=int, default=10,
                   help="smallest token id drawn, to keep clear of special tokens "
                   "(default: %(default)s)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the requested lengths; --no-ignore-eos lets requests "
                   "stop at eos (default: %(default)s)")
    p.add_argument("--label", default=None,
                   help="free text stored in the JSON (default: %(default)s)")
    p.add_argument("--result-file", default=None,
                   help="write the summary (and config) as JSON (default: %(default)s)")
    p.add_argument("--save-detailed", action=argparse.BooleanOptionalAction, default=False,
                   help="also write every request's send time, TTFT, ITLs and error to the JSON "
                   "(default: %(default)s)")


async def served_vocab_size(base_url: str, model: str | None = None,
                            api_key: str | None = None) -> int:
    """The served model's vocabulary size: `vocab_size` on its /v1/models card when the server
    gives one, else read from the 400 that /v1/completions answers for an out-of-vocabulary
    stop_token_ids entry (the request is refused before any generation)."""
    ep = Endpoint.parse(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    cards = (await get_json(ep, "/v1/models", headers)).get("data") or []
    card = next((c for c in cards if model is None or c.get("id") == model), None)
    if card is None:
        raise ValueError(f"the server at {base_url} serves no model {model!r}")
    if isinstance(card.get("vocab_size"), int):
        return card["vocab_size"]
    probe = {"model": card["id"], "prompt": [0], "max_tokens": 1,
             "stop_token_ids": [_PROBE_TOKEN_ID]}
    try:
        async for _ in request(ep, "POST", "/v1/completions", probe, headers):
            pass
    except HTTPError as e:
        found = _VOCAB_IN_ERROR.search(e.body)
        if found:
            return int(found.group(1))
    raise ValueError(f"could not learn the vocabulary size from the server at {base_url}: "
                     "pass --vocab-size")


# A token id no vocabulary reaches (int32's largest), and the server's words for refusing it.
_PROBE_TOKEN_ID = 2**31 - 1
_VOCAB_IN_ERROR = re.compile(r"outside the vocabulary \[0, (\d+)\)")


def build_requests(ns: argparse.Namespace) -> list[BenchRequest]:
    if ns.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if ns.dataset == "random":
        return random_dataset(ns.num_prompts, ns.random_input_len, ns.random_output_len,
                              ns.random_range_ratio, ns.vocab_size, ns.seed, ns.min_token_id)
    return prefix_shared_dataset(ns.num_prompts, ns.prefix_len, ns.suffix_len, ns.output_len,
                                 ns.vocab_size, ns.seed, ns.min_token_id)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `peregrine bench serve`; returns the exit code."""
    parser = argparse.ArgumentParser(prog="peregrine bench serve", description=__doc__)
    add_cli_args(parser)
    return run(parser.parse_args(argv))


def run(ns: argparse.Namespace) -> int:
    """Run the parsed serving benchmark, print its summary (and JSON); returns the exit code."""
    try:
        if ns.vocab_size is None:
            ns.vocab_size = asyncio.run(served_vocab_size(ns.base_url, ns.model, ns.api_key))
        reqs = build_requests(ns)
        summary, results = asyncio.run(run_benchmark(
            ns.base_url, ns.model, reqs, request_rate=ns.request_rate,
            max_concurrency=ns.max_concurrency, seed=ns.seed, api_key=ns.api_key,
            ignore_eos=ns.ignore_eos))
    except (ValueError, OSError, HTTPError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    if ns.result_file:
        config = {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf")
                  for k, v in vars(ns).items()}
        summary = dict(summary, request_rate=config["request_rate"])
        data: dict[str, Any] = {"config": config, "summary": summary}
        if ns.save_detailed:
            data["requests"] = detailed(results)
        with open(ns.result_file, "w") as f:
            json.dump(data, f, indent=2)
    return 0 if summary["failed_requests"] == 0 else 1

