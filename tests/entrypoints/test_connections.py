"""Connection limits under the real app and uvicorn: the cap (503 beyond it), the request read
deadline (slowloris), the header size cap, the accept-error log rate limit, the open-file limit,
keep-alive against clients' idle expiry, and a burst of a thousand streaming connections."""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import resource
import socket
import time

import httpx
import pytest

from fake_engine import FakeEngine
from peregrine.entrypoints.openai.api_server import ServerArgs
from peregrine.entrypoints.openai.uvicorn_server import (AcceptErrorFilter, raise_open_file_limit,
                                                         warn_if_backlog_capped)
from server_utils import FakeServerProcess, RunningServer


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


def test_a_cap_of_n_serves_n_connections():
    # NOTE: uvicorn counts the asking connection against its limit; the cap must not.
    with RunningServer(FakeEngine(), max_connections=4) as s:
        held = [_connect(s.port) for _ in range(3)]
        assert _wait_until(lambda: len(s._server.server_state.connections) == 3)
        assert httpx.get(s.base_url + "/health", timeout=5).status_code == 200  # the 4th
        for sock in held:
            sock.close()


def test_open_file_limit_is_raised_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, target), hard))
        assert raise_open_file_limit() == (target, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (target, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_idle_connections_outlive_the_clients_keep_alive_expiry():
    # NOTE: a server closing an idle connection at the moment its client reuses it fails that
    # request with a connection error, which clients retry only with retries on.
    import openai
    server = ServerArgs().keep_alive_timeout
    assert server > httpx.Limits().keepalive_expiry
    assert server > openai.DEFAULT_CONNECTION_LIMITS.keepalive_expiry


_BURST = 1000


async def _stream_twice(port: int, body: bytes) -> list[tuple[int, bytes]]:
    """Open a connection, send a streaming request, read it whole, send a second one on the same
    (kept-alive) connection unless the server closes it; the (status, body) of each."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    answers = []
    try:
        for _ in range(2):
            writer.write(head + body)
            status = int((await reader.readline()).split()[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            if headers.get("transfer-encoding") == "chunked":
                data = b""
                while size := int((await reader.readline()).strip(), 16):
                    data += await reader.readexactly(size + 2)
                await reader.readline()
            else:
                data = await reader.readexactly(int(headers["content-length"]))
            answers.append((status, data))
            if headers.get("connection") == "close":
                break
    finally:
        writer.close()
    return answers


@pytest.mark.slow
def test_a_burst_of_a_thousand_streaming_connections_gets_no_error():
    # NOTE: the server starts with the common soft open-file limit of 1,024; serving raises it,
    # else the connection cap (that limit less a reserve) would answer 503 to the last ~60.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < _BURST + 256:
        pytest.skip(f"the hard open-file limit {hard} is below {_BURST + 256}")
    body = json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 8,
                       "stream": True}).encode()

    async def burst(port: int) -> list:
        return await asyncio.gather(*[_stream_twice(port, body) for _ in range(_BURST)],
                                    return_exceptions=True)

    raise_open_file_limit()
    try:
        with FakeServerProcess(soft_nofile=1024, max_num_seqs=_BURST) as s:
            results = asyncio.run(burst(s.port))
            log = s.stop()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of {_BURST} failed, e.g. {errors[0]!r}"
    answers = [a for r in results for a in r]
    statuses = collections.Counter(status for status, _ in answers)
    assert statuses == {200: 2 * _BURST}, (statuses, log[-2000:])
    assert all(data.rstrip().endswith(b"data: [DONE]") for _, data in answers)
    assert "Traceback" not in log, log[-3000:]


def test_a_listen_backlog_capped_by_the_kernel_is_reported(tmp_path, caplog):
    somaxconn = tmp_path / "somaxconn"
    somaxconn.write_text("128\n")
    with caplog.at_level(logging.WARNING):
        assert warn_if_backlog_capped(2048, str(somaxconn)) == 128
    assert "listen backlog is 128, not 2048" in caplog.text
    caplog.clear()
    somaxconn.write_text("4096\n")
    assert warn_if_backlog_capped(2048, str(somaxconn)) == 2048
    assert warn_if_backlog_capped(2048, str(tmp_path / "absent")) == 2048
    assert caplog.text == ""
