"""SIGTERM on a real `run_server` process (fake engine): bounded drain, then aborted streams end
with an error event and [DONE], non-streaming requests get 503, and the process exits."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parents[1]
_SERVER = """
import logging, sys
sys.path.insert(0, {tests!r})
from fake_engine import FakeEngine
from peregrine.engine.async_engine import AsyncEngine
from peregrine.entrypoints.openai.api_server import ServerArgs, run_server
logging.basicConfig(level=logging.INFO)
engine = AsyncEngine(FakeEngine(max_model_len=100_000, step_delay=0.02))
run_server(engine, ServerArgs(port=0, shutdown_timeout={timeout}, log_stats_interval=0))
"""


def _start(timeout: float) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", _SERVER.format(tests=str(TESTS), timeout=timeout)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        m = re.search(r"on http://[\d.]+:(\d+)", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return proc, f"http://127.0.0.1:{m.group(1)}"
    proc.kill()
    pytest.fail("server did not report its port")


def _stream(base: str, max_tokens: int, events: list, started: threading.Event) -> None:
    body = {"prompt": "hi", "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def _post(base: str, result: list) -> None:
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 90_000}, timeout=30)
    result.append(r)


def _open_streams(base: str, n: int, max_tokens: int) -> tuple[list[list[str]], list[threading.Thread]]:
    streams, threads = [], []
    for _ in range(n):
        events: list[str] = []
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(base, max_tokens, events, started), daemon=True)
        t.start()
        assert started.wait(10), "stream did not start"
        streams.append(events)
        threads.append(t)
    return streams, threads


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.slow  # (it waits out the shutdown timeout)
def test_sigterm_aborts_open_requests_after_the_timeout_and_exits():
    timeout = 2.0
    proc, base = _start(timeout)
    try:
        streams, threads = _open_streams(base, 3, max_tokens=90_000)  # ~30 min of tokens each
        plain: list[httpx.Response] = []
        waiter = threading.Thread(target=_post, args=(base, plain), daemon=True)
        waiter.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # the listener is closed at once
            httpx.get(base + "/health", timeout=2)
        proc.wait(timeout=timeout + 8)
        elapsed = time.monotonic() - t0
        assert timeout - 0.5 < elapsed < timeout + 8  # it drained for the timeout, then exited
        for t in [*threads, waiter]:
            t.join(5)
        for events in streams:
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["message"] == "server is shutting down"
            assert err["code"] == "server_shutting_down"
            assert len(events) > 3  # tokens flowed during the drain
        assert plain[0].status_code == 503
        assert plain[0].json()["error"]["code"] == "server_shutting_down"
    finally:
        _stop(proc)


def test_sigterm_lets_requests_that_finish_in_time_complete():
    proc, base = _start(timeout=20.0)
    try:
        streams, threads = _open_streams(base, 2, max_tokens=40)  # ~1 s each
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        assert time.monotonic() - t0 < 8  # it waited for the streams, not for the timeout
        for t in threads:
            t.join(5)
        for events in streams:
            assert events[-1] == "[DONE]"
            last = json.loads(events[-2])
            assert "error" not in last and last["choices"][0]["finish_reason"] == "length"
    finally:
        _stop(proc)


def test_second_signal_aborts_at_once_and_streams_still_end_with_done():
    proc, base = _start(timeout=60.0)
    try:
        streams, threads = _open_streams(base, 2, max_tokens=90_000)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        assert time.monotonic() - t0 < 10
        for t in threads:
            t.join(5)
        for events in streams:
            assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    finally:
        _stop(proc)
