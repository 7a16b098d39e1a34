"""A minimal asyncio HTTP/1.1 client for the serving benchmark: stdlib only, one connection per
request (no pool limits to skew arrivals), server-sent events parsed as they arrive."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class HTTPError(Exception):
    """A non-2xx answer; `body` holds what the server sent."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    base_path: str

    @classmethod
    def parse(cls, base_url: str) -> Endpoint:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"base url must look like http://host:port, got {base_url!r}")
        return cls(u.hostname, u.port or 80, u.path.rstrip("/"))


async def _read_headers(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    parts = status_line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise ConnectionError(f"bad status line {status_line!r}")
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()  # the empty line after the last chunk
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)  # CRLF
            yield data
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


async def request(ep: Endpoint, method: str, path: str, payload: Any = None,
                  headers: dict[str, str] | None = None) -> AsyncIterator[bytes]:
    """Send one request; yield the response body as it arrives. Non-2xx raises HTTPError."""
    reader, writer = await asyncio.open_connection(ep.host, ep.port)
    try:
        body = b"" if payload is None else json.dumps(payload).encode()
        head = [f"{method} {ep.base_path}{path} HTTP/1.1", f"Host: {ep.host}:{ep.port}",
                "Connection: close", "Accept: */*", f"Content-Length: {len(body)}"]
        if payload is not None:
            head.append("Content-Type: application/json")
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        status, resp_headers = await _read_headers(reader)
        if not 200 <= status < 300:
            data = b"".join([c async for c in _body_chunks(reader, resp_headers)])
            raise HTTPError(status, data.decode("utf-8", "replace"))
        async for chunk in _body_chunks(reader, resp_headers):
            yield chunk
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


async def get_json(ep: Endpoint, path: str, headers: dict[str, str] | None = None) -> Any:
    data = b"".join([c async for c in request(ep, "GET", path, None, headers)])
    return json.loads(data)


async def post_sse(ep: Endpoint, path: str, payload: Any,
                   headers: dict[str, str] | None = None) -> AsyncIterator[str]:
    """POST and yield each server-sent event's data (the text after "data: ")."""
    buf = b""
    async for chunk in request(ep, "POST", path, payload, headers):
        buf += chunk
        while True:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            event, buf = buf[:end], buf[end + 2:]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode("utf-8")
