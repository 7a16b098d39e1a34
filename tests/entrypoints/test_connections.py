"""Connection limits under the real app and uvicorn: the cap (503 beyond it), the request read
deadline (slowloris), the header size cap, and the accept-error log rate limit."""
from __future__ import annotations

import logging
import socket
import time

import httpx

from fake_engine import FakeEngine
from peregrine.entrypoints.openai.uvicorn_server import AcceptErrorFilter
from server_utils import RunningServer


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_connection_beyond_the_cap_gets_503_and_serving_resumes():
    with RunningServer(FakeEngine(), max_connections=4) as s:
        held = [_connect(s.port) for _ in range(4)]
        state = s._server.server_state
        assert _wait_until(lambda: len(state.connections) == 4)
        r = httpx.get(s.base_url + "/health", timeout=5)  # the 5th connection
        assert r.status_code == 503
        for sock in held:
            sock.close()
        assert _wait_until(lambda: len(state.connections) == 0)
        assert httpx.get(s.base_url + "/health", timeout=5).status_code == 200
        r = httpx.post(s.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200


def test_connection_that_does_not_finish_its_request_in_time_is_closed():
    with RunningServer(FakeEngine(), request_read_timeout=0.5) as s:
        sock = _connect(s.port)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never end
        t0 = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server
        assert time.monotonic() - t0 < 3
        sock.close()
        assert httpx.get(s.base_url + "/health", timeout=5).status_code == 200


def test_unfinished_request_head_over_the_cap_gets_400():
    # NOTE: h11 bounds what it buffers before a head is complete, not a head that arrives whole.
    with RunningServer(FakeEngine(), max_header_bytes=2048) as s:
        sock = _connect(s.port)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nx-big: " + b"a" * 4096)
        assert sock.recv(1024).startswith(b"HTTP/1.1 400")
        sock.close()
        assert httpx.get(s.base_url + "/health", timeout=5).status_code == 200


def _record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)


def test_accept_errors_are_logged_once_per_interval_with_a_count_of_the_rest():
    f = AcceptErrorFilter(interval=0.2)
    accept = "socket.accept() out of system resource\nexception: [Errno 24] Too many open files"
    assert f.filter(_record(accept))
    assert [f.filter(_record(accept)) for _ in range(5)] == [False] * 5
    assert f.filter(_record("something else"))  # other lines pass untouched
    time.sleep(0.25)
    rec = _record(accept)
    assert f.filter(rec) and "5 more like this were not logged" in rec.getMessage()
