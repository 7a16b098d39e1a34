"""Soak test of one running server: rounds of concurrent streaming requests (some aborted by the
client at random points, some malformed on purpose, a few greedy canaries), and after each round
the checks that say the server stays up: no 5xx, no client error, nothing left running, the same
canary text every round, memory flat.

    python benchmarks/soak.py --rounds 5 --requests 1000 --json soak.json -- MODEL --max-num-seqs 1024
    python benchmarks/soak.py --url http://127.0.0.1:8000 --server-pid PID

Arguments after `--` go to `peregrine serve` (the script picks the port and starts it), or
--url names a server that is already running (--server-pid adds its memory to the checks).
Prints a table per round and writes JSON; exits 1 when a check fails. On the CPU a server takes
its KV cache's memory as blocks are first written, so that the first rounds' growth is the
cache's: give it few blocks (`-- MODEL --num-gpu-blocks-override 256`) for the memory check.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import local_server  # noqa: E402
from peregrine.entrypoints.openai.serving_common import prompt_char_limit  # noqa: E402

_MIB = 1 << 20
# Malformed requests, cycled; each must get a 4xx in OpenAI's error shape.
MALFORMED_KINDS = ("bad_json", "wrong_type", "unknown_field", "oversize_prompt", "lone_surrogate")
_GAUGES = ("peregrine_num_requests_running", "peregrine_num_requests_waiting")
_CANARY_PROMPTS = ("def fibonacci(n):\n", "import os\n\n\nclass ", "# Copyright ", "for i in range(")


@dataclass
class RoundResult:
    round: int
    requests: int = 0
    completed: int = 0  # streams that ended with [DONE], and canaries answered
    aborted: int = 0  # closed by the client on purpose
    malformed_4xx: int = 0  # malformed requests answered with an OpenAI-shaped 4xx
    status_5xx: int = 0
    unexpected_status: int = 0  # any other non-200 (a valid request refused, a malformed one served)
    client_errors: int = 0  # connection failures, timeouts, broken streams
    canary_mismatches: int = 0
    seconds: float = 0.0
    output_tokens: int = 0
    drain_seconds: float = 0.0  # until the running and waiting gauges read 0
    gauges_after: dict[str, float] = field(default_factory=dict)
    rss_mib: float | None = None  # server process tree
    gpu_mib: float | None = None  # server process tree, nvidia-smi
    listen_overflows: int | None = None  # this machine's TCP accept-queue overflows in the round
    server_tracebacks: int | None = None  # new "Traceback" lines in the server's log
    samples: list[str] = field(default_factory=list)  # a few failures, verbatim


# ---------------------------------------------------------------- what the server sees
def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return kids


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process tree in MiB; None where /proc cannot say."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            if p == pid:
                return None
    return total / 1024


def gpu_mib(pid: int) -> float | None:
    """GPU memory of a process tree in MiB (nvidia-smi); None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    pids = set(process_tree(pid))
    used = [float(m) for p, m in (line.split(",") for line in out.strip().splitlines() if line)
            if int(p) in pids]
    return sum(used)  # NOTE: 0.0 when the process tree holds no GPU memory (a CPU server)


def listen_overflows() -> int | None:
    """This machine's TcpExt ListenOverflows + ListenDrops (accept queue full), if readable."""
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:]))
            return int(row.get("ListenOverflows", 0)) + int(row.get("ListenDrops", 0))
    return None


def read_gauges(text: str) -> dict[str, float]:
    """The running/waiting gauges from a Prometheus exposition (summed over labels)."""
    out = {name: 0.0 for name in _GAUGES}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"nofile": resource.getrlimit(resource.RLIMIT_NOFILE)}
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            env["somaxconn"] = int(f.read())
    except OSError:
        pass
    return env


# ---------------------------------------------------------------- the requests
def malformed_request(kind: str, model: str, max_prompt_chars: int) -> tuple[str, bytes]:
    """(path, body) of a request the server must refuse with a 4xx."""
    if kind == "bad_json":
        return "/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": "hi",'
    if kind == "wrong_type":
        body: dict[str, Any] = {"model": model, "prompt": "hi", "max_tokens": "many"}
    elif kind == "unknown_field":
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "no_such_field": True}
        return "/v1/chat/completions", json.dumps(body).encode()
    elif kind == "oversize_prompt":
        body = {"model": model, "prompt": "a" * (max_prompt_chars + 1), "max_tokens": 1}
    elif kind == "lone_surrogate":
        return "/v1/completions", (b'{"model": "' + model.encode()
                                   + b'", "prompt": "x\\ud800y", "max_tokens": 1}')
    else:
        raise ValueError(f"unknown malformed kind {kind!r}; known: {MALFORMED_KINDS}")
    return "/v1/completions", json.dumps(body).encode()


def _describe(e: BaseException) -> str:
    """The exception and its causes, e.g. 'APIConnectionError <- RemoteProtocolError: ...'."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}"[:200])
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


class Round:
    """One round's requests against the server, tallied into a RoundResult."""

    def __init__(self, index: int, args: argparse.Namespace, client: openai.AsyncOpenAI,
                 raw: httpx.AsyncClient, model: str, max_prompt_chars: int) -> None:
        self.args = args
        self.client = client
        self.raw = raw
        self.model = model
        self.max_prompt_chars = max_prompt_chars
        self.rng = random.Random(args.seed * 1000 + index)
        self.result = RoundResult(index)
        self.canary_texts: dict[int, str] = {}

    def _fail(self, what: str) -> None:
        if len(self.result.samples) < 10:
            self.result.samples.append(what)

    async def stream(self, i: int, abort_after: int | None) -> None:
        """A streaming completion; abort_after = k: the client closes it after k chunks (0:
        before the answer)."""
        prompt = self.prompt(f"{i}: " + self.rng.choice(_CANARY_PROMPTS))
        try:
            coro = self.client.completions.create(
                model=self.model, prompt=prompt, max_tokens=self.args.max_tokens, stream=True,
                temperature=1.0, seed=i)
            if abort_after == 0:
                task = asyncio.ensure_future(coro)
                await asyncio.sleep(self.rng.uniform(0.0, 0.05))
                if not task.done():
                    task.cancel()
                    self.result.aborted += 1
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
                    return
                stream = task.result()
            else:
                stream = await coro
            chunks = 0
            async for chunk in stream:
                chunks += 1
                self.result.output_tokens += 1 if chunk.choices and chunk.choices[0].text else 0
                if abort_after is not None and chunks >= abort_after:
                    await stream.close()
                    self.result.aborted += 1
                    return
            self.result.completed += 1
        except openai.APIStatusError as e:
            self._status(e.status_code, f"stream {i}: {e.status_code} {e.message[:200]}")
        except (openai.APIError, httpx.HTTPError, OSError) as e:
            self.result.client_errors += 1
            self._fail(f"stream {i}: {_describe(e)}")

    def _status(self, status: int, what: str) -> None:
        if status >= 500:
            self.result.status_5xx += 1
        else:
            self.result.unexpected_status += 1
        self._fail(what)

    def prompt(self, text: str) -> str | list[int]:
        """The text, or with --token-prompts token ids made from it (a server without a
        tokenizer takes only those; ids 10..499 exist in every vocabulary served here)."""
        if not self.args.token_prompts:
            return text
        return [10 + (b * 7 + j) % 490 for j, b in enumerate(text.encode())]

    async def canary(self, c: int) -> None:
        try:
            r = await self.client.completions.create(
                model=self.model, prompt=self.prompt(_CANARY_PROMPTS[c % len(_CANARY_PROMPTS)]),
                max_tokens=self.args.max_tokens, temperature=0.0, logprobs=1)
            # NOTE: the tokens too: without a tokenizer the text is empty, the tokens are ids.
            tokens = r.choices[0].logprobs.tokens if r.choices[0].logprobs else []
            self.canary_texts[c] = r.choices[0].text + "|" + " ".join(tokens or [])
            self.result.completed += 1
        except openai.APIStatusError as e:
            self._status(e.status_code, f"canary {c}: {e.status_code} {e.message[:200]}")
        except (openai.APIError, httpx.HTTPError, OSError) as e:
            self.result.client_errors += 1
            self._fail(f"canary {c}: {_describe(e)}")

    async def malformed(self, kind: str) -> None:
        path, body = malformed_request(kind, self.model, self.max_prompt_chars)
        try:
            r = await self.raw.post(path, content=body,
                                    headers={"Content-Type": "application/json"})
        except httpx.HTTPError as e:
            self.result.client_errors += 1
            self._fail(f"malformed {kind}: {_describe(e)}")
            return
        try:
            err = r.json()["error"]
            shaped = set(err) == {"message", "type", "param", "code"}
        except (ValueError, KeyError, TypeError):
            shaped = False
        if 400 <= r.status_code < 500 and shaped:
            self.result.malformed_4xx += 1
        else:
            self._status(r.status_code, f"malformed {kind}: {r.status_code} {r.text[:200]}")

    async def run(self) -> RoundResult:
        n, a = self.args.requests, self.args
        jobs = []
        for i in range(n):
            u = self.rng.random()
            if u < a.malformed_fraction:
                jobs.append(self.malformed(MALFORMED_KINDS[i % len(MALFORMED_KINDS)]))
            elif u < a.malformed_fraction + a.abort_fraction:
                jobs.append(self.stream(i, self.rng.randrange(0, a.max_tokens)))
            else:
                jobs.append(self.stream(i, None))
        jobs += [self.canary(c) for c in range(a.canaries)]
        self.result.requests = len(jobs)
        t0 = time.monotonic()
        await asyncio.gather(*jobs)
        self.result.seconds = time.monotonic() - t0
        return self.result


# ---------------------------------------------------------------- the server
def start_server(serve_args: list[str], log_path: str,
                 timeout: float) -> tuple[subprocess.Popen, str]:
    """`peregrine serve SERVE_ARGS` on a free local port; (process, base url) once healthy."""
    return local_server.start_server(
        [sys.executable, "-m", "peregrine.entrypoints.cli", "serve", *serve_args], log_path, timeout)


stop_server = local_server.stop_server


def _count_tracebacks(log_path: str | None) -> int | None:
    if log_path is None:
        return None
    with open(log_path, errors="replace") as f:
        return f.read().count("Traceback (most recent call last)")


# ---------------------------------------------------------------- the checks
def check_rounds(rounds: list[RoundResult], canaries: list[dict[int, str]], *,
                 rss_tolerance_mib: float, rss_tolerance_frac: float,
                 gpu_tolerance_mib: float, baseline_round: int = 1) -> list[str]:
    """What failed, one line each (empty: the soak passed). Memory after each round past
    `baseline_round` may exceed the baseline round's by the stated tolerance only (the first
    rounds warm up: allocator pools, caches)."""
    bad = []
    for r in rounds:
        k = r.round
        if r.status_5xx:
            bad.append(f"round {k}: {r.status_5xx} answers with a 5xx status")
        if r.unexpected_status:
            bad.append(f"round {k}: {r.unexpected_status} unexpected statuses")
        if r.client_errors:
            bad.append(f"round {k}: {r.client_errors} client errors")
        if any(v != 0 for v in r.gauges_after.values()):
            bad.append(f"round {k}: gauges not back to 0: {r.gauges_after}")
        if r.server_tracebacks:
            bad.append(f"round {k}: {r.server_tracebacks} new tracebacks in the server log")
    first = canaries[0] if canaries else {}
    for r, texts in zip(rounds[1:], canaries[1:]):
        diff = sorted(c for c in first if texts.get(c) != first[c])
        if diff:
            r.canary_mismatches = len(diff)
            bad.append(f"round {r.round}: canaries {diff} differ from round {rounds[0].round}")
    b = min(max(baseline_round, 1), len(rounds))
    base = rounds[b - 1] if rounds else None
    for r in rounds[b:]:
        if base.rss_mib is not None and r.rss_mib is not None:
            tol = max(rss_tolerance_mib, rss_tolerance_frac * base.rss_mib)
            if r.rss_mib > base.rss_mib + tol:
                bad.append(f"round {r.round}: server RSS {r.rss_mib:.0f} MiB grew more than "
                           f"{tol:.0f} MiB over round {base.round}'s {base.rss_mib:.0f} MiB")
        if base.gpu_mib is not None and r.gpu_mib is not None:
            if r.gpu_mib > base.gpu_mib + gpu_tolerance_mib:
                bad.append(f"round {r.round}: GPU memory {r.gpu_mib:.0f} MiB grew more than "
                           f"{gpu_tolerance_mib:.0f} MiB over {base.gpu_mib:.0f} MiB")
    return bad


_COLUMNS = ("round", "requests", "completed", "aborted", "malformed_4xx", "status_5xx",
            "client_errors", "canary_mismatches", "seconds", "drain_seconds", "rss_mib",
            "gpu_mib", "listen_overflows")


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def format_table(rounds: list[RoundResult], header: bool = True) -> str:
    """One line per round (and a header line), columns as wide as their names."""
    lines = [" ".join(_COLUMNS)] if header else []
    lines += [" ".join(f"{_cell(getattr(r, c)):>{len(c)}}" for c in _COLUMNS) for r in rounds]
    return "\n".join(lines)


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (else the script starts `peregrine serve` "
                   "with the arguments after --)")
    p.add_argument("--server-pid", type=int, help="with --url: the server's pid, for its memory")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=1000, help="concurrent requests per round")
    p.add_argument("--abort-fraction", type=float, default=0.2)
    p.add_argument("--malformed-fraction", type=float, default=0.05)
    p.add_argument("--canaries", type=int, default=4, help="greedy requests checked every round")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds for the gauges to reach 0 after a round")
    p.add_argument("--baseline-round", type=int, default=2,
                   help="memory after later rounds is compared with this round's (the first "
                   "rounds warm up)")
    p.add_argument("--rss-tolerance-mib", type=float, default=256.0)
    p.add_argument("--rss-tolerance-frac", type=float, default=0.05,
                   help="RSS may exceed the baseline round's by max(this fraction, "
                   "--rss-tolerance-mib)")
    p.add_argument("--gpu-tolerance-mib", type=float, default=256.0)
    p.add_argument("--token-prompts", action="store_true",
                   help="send token ids, not text (for a server without a tokenizer, such as "
                   "`peregrine serve CONFIG.json`)")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="the server's --max-prompt-chars, if set (oversize prompts exceed it)")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--server-log", help="the started server's log (default: a temporary file)")
    args = p.parse_args(argv)
    if args.url is None and args.server_pid is not None:
        p.error("--server-pid goes with --url")
    if args.url is not None and serve_args:
        p.error("give --url or serve arguments after --, not both")
    for name in ("rounds", "requests", "max_tokens", "baseline_round"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.canaries < 0:
        p.error("--canaries must be >= 0")
    if not (0 <= args.abort_fraction and 0 <= args.malformed_fraction
            and args.abort_fraction + args.malformed_fraction <= 1):
        p.error("--abort-fraction and --malformed-fraction must be >= 0 and sum to <= 1")
    return args, serve_args


async def _drain(raw: httpx.AsyncClient, timeout: float) -> tuple[float, dict[str, float]]:
    t0 = time.monotonic()
    while True:
        gauges = read_gauges((await raw.get("/metrics")).text)
        if all(v == 0 for v in gauges.values()) or time.monotonic() - t0 > timeout:
            return time.monotonic() - t0, gauges
        await asyncio.sleep(0.2)


async def soak(args: argparse.Namespace, url: str, pid: int | None,
               log_path: str | None) -> dict[str, Any]:
    # NOTE: one pool connection per concurrent request, the openai client's other defaults
    # (5 s connect timeout, 5 s keep-alive) and no retries: every failure is counted.
    limits = httpx.Limits(max_connections=args.requests + args.canaries + 16,
                          max_keepalive_connections=100, keepalive_expiry=5.0)
    timeout = httpx.Timeout(600.0, connect=5.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http, \
            httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as raw:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="soak", max_retries=0,
                                    http_client=http)
        card = (await raw.get("/v1/models")).json()["data"][0]
        model, max_len = card["id"], card["max_model_len"]
        max_prompt_chars = prompt_char_limit(max_len, args.max_prompt_chars)
        rounds, canaries = [], []
        tracebacks = _count_tracebacks(log_path)
        for k in range(1, args.rounds + 1):
            overflow0 = listen_overflows()
            rnd = Round(k, args, client, raw, model, max_prompt_chars)
            r = await rnd.run()
            r.drain_seconds, r.gauges_after = await _drain(raw, args.drain_timeout)
            overflow1 = listen_overflows()
            if overflow0 is not None and overflow1 is not None:
                r.listen_overflows = overflow1 - overflow0
            if pid is not None:
                r.rss_mib, r.gpu_mib = rss_mib(pid), gpu_mib(pid)
            now = _count_tracebacks(log_path)
            if now is not None:
                r.server_tracebacks, tracebacks = now - tracebacks, now
            rounds.append(r)
            canaries.append(rnd.canary_texts)
            print(format_table([r], header=k == 1), flush=True)
    failures = check_rounds(rounds, canaries, rss_tolerance_mib=args.rss_tolerance_mib,
                            rss_tolerance_frac=args.rss_tolerance_frac,
                            gpu_tolerance_mib=args.gpu_tolerance_mib,
                            baseline_round=args.baseline_round)
    return {"url": url, "model": model, "settings": vars(args), "environment": environment(),
            "rounds": [asdict(r) for r in rounds], "canary_texts": canaries[0] if canaries else {},
            "failures": failures, "passed": not failures}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the soak; returns the results (what --json writes)."""
    args, serve_args = parse_args(argv)
    # NOTE: each concurrent request is an open file here; a soft limit of 1,024 fails a burst.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.requests + args.canaries + 256
    if soft < want and (hard == resource.RLIM_INFINITY or hard >= want):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    proc = None
    log_path = args.server_log
    if args.url is None:
        if log_path is None:
            log_path = tempfile.mkstemp(prefix="peregrine-soak-", suffix=".log")[1]
        proc, url = start_server(serve_args, log_path, args.start_timeout)
        pid = proc.pid
    else:
        url, pid = args.url.rstrip("/"), args.server_pid
    try:
        result = asyncio.run(soak(args, url, pid, log_path))
    finally:
        if proc is not None:
            stop_server(proc)
    result["server_log"] = log_path
    for line in result["failures"]:
        print("FAIL:", line)
    for r in result["rounds"]:
        for s in r["samples"]:
            print(f"  round {r['round']}: {s}")
    print("soak passed" if result["passed"] else "soak FAILED", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
