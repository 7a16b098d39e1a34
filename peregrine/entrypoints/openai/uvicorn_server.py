"""uvicorn pieces of the server: a shutdown with a bounded drain, a per-request read deadline
(slowloris), the connection cap counted as uvicorn should, the open-file limit raised for a
thousand clients, a warning when the kernel caps the listen backlog, and a rate limit on
asyncio's accept-error log line (EMFILE storms)."""
from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

# NOTE: after the abort, streams still need a moment to send their error event and [DONE].
FLUSH_GRACE_S = 5.0
_ACCEPT_ERROR = "socket.accept() out of system resource"
_UNLIMITED_FILES = 1 << 20
_SOMAXCONN = "/proc/sys/net/core/somaxconn"


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown stops accepting, lets open requests run for `drain_timeout`
    seconds, then awaits `abort()` (which must end every open stream) and lets them flush.

    A second SIGTERM/SIGINT during the drain aborts at once (a third SIGINT force-quits).
    """

    def __init__(self, config: uvicorn.Config, *, drain_timeout: float,
                 on_drain: Callable[[], None], abort: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self.drain_timeout = drain_timeout
        self._on_drain = on_drain
        self._abort = abort
        self._abort_now = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and not self._abort_now:
            self._abort_now = True  # polled by _abort_at; nothing else is safe in a signal handler
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_drain()
        aborter = asyncio.create_task(self._abort_at(time.monotonic() + self.drain_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            aborter.cancel()
        # NOTE: a forced exit skips the lifespan, which is what stops the engine otherwise;
        # stopping it here too means no engine-core process outlives the server.
        await self._abort()

    async def _abort_at(self, deadline: float) -> None:
        while time.monotonic() < deadline and not self._abort_now:
            await asyncio.sleep(0.05)
        n = len(self.server_state.tasks)
        if n:
            logger.warning("shutdown: aborting %d open request(s)", n)
        await self._abort()


def h11_with_read_timeout(read_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request (headers and body) is not
    fully received `read_timeout` seconds after the connection opened or its last response, and
    serving up to `limit_concurrency` connections (uvicorn serves one fewer)."""

    class ReadTimeoutH11(H11Protocol):
        _read_timer: asyncio.TimerHandle | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # NOTE: uvicorn refuses a request once len(connections) >= limit_concurrency, and
            # that count includes the connection asking, so a cap of N served N - 1 clients.
            if self.limit_concurrency is not None:
                self.limit_concurrency += 1

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_read_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_read_timer()

        def _arm_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
            self._read_timer = self.loop.call_later(read_timeout, self._on_read_timeout)

        def _on_read_timeout(self) -> None:
            self._read_timer = None
            cycle = self.cycle
            # No request yet, the next one not started, or its body still arriving.
            if cycle is None or cycle.response_complete or cycle.more_body:
                if not self.transport.is_closing():
                    logger.debug("closing a connection: request not read within %.1fs",
                                 read_timeout)
                    self.transport.close()

    return ReadTimeoutH11


def raise_open_file_limit() -> tuple[int, int] | None:
    """Raise this process's soft open-file limit to its hard limit (each client connection is a
    file; a soft limit of 1,024 is common); returns (soft, hard) after, None where unknown."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    # NOTE: Linux refuses an unlimited soft limit for files; 2**20 is its usual ceiling.
    target = _UNLIMITED_FILES if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as e:
            logger.warning("could not raise the open-file limit from %d to %d: %s",
                           soft, target, e)
    return soft, hard


def warn_if_backlog_capped(requested: int, somaxconn_path: str = _SOMAXCONN) -> int:
    """The listen backlog the kernel grants (Linux caps it at net.core.somaxconn, silently);
    logs a warning when that is below `requested`."""
    try:
        with open(somaxconn_path) as f:
            cap = int(f.read().strip())
    except (OSError, ValueError):
        return requested
    if cap >= requested:
        return requested
    # NOTE: a full accept queue drops new SYNs; the client resends after 1, 3, 7 s, so a burst
    # of more connections than this can fail with a connect timeout (5 s in the openai client).
    logger.warning("the listen backlog is %d, not %d (net.core.somaxconn); a burst of more "
                   "new connections than that can time out: raise it with `sysctl -w "
                   "net.core.somaxconn=%d`", cap, requested, requested)
    return cap


class AcceptErrorFilter(logging.Filter):
    """Lets one of asyncio's "socket.accept() out of system resource" records through per
    `interval` seconds; the next one that passes says how many were dropped."""

    def __init__(self, interval: float = 10.0) -> None:
        super().__init__()
        self.interval = interval
        self._last = -math.inf
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(_ACCEPT_ERROR):
            return True
        now = time.monotonic()
        if now - self._last < self.interval:
            self._dropped += 1
            return False
        self._last = now
        if self._dropped:
            record.msg = f"{record.msg}\n({self._dropped} more like this were not logged)"
            self._dropped = 0
        return True


def install_accept_error_filter(interval: float = 10.0) -> None:
    """Rate-limit the accept-error line on the asyncio logger (once per process)."""
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, AcceptErrorFilter) for f in log.filters):
        log.addFilter(AcceptErrorFilter(interval))

