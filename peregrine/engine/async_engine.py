"""AsyncEngine: one background thread drives a synchronous LLMEngine; each request (or group of
requests) gets an asyncio stream of its outputs."""
from __future__ import annotations

import asyncio
import collections
import copy
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from peregrine.engine.core_client import EngineCoreDeadError
from peregrine.engine.stats import EngineStats
from peregrine.outputs import RequestOutput, merge_outputs
from peregrine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from peregrine.config import EngineArgs

logger = logging.getLogger(__name__)

# NOTE: after this many consecutive failed step() calls the engine is declared dead (503 on /health).
_MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served any more."""


class RequestAbortedError(RuntimeError):
    """The request was aborted by the server (shutdown or a failed step) before it finished."""


class ServerShuttingDownError(RequestAbortedError):
    """The request was still running when the server shut down."""


class RequestObserver(Protocol):
    """Hooks called on the event loop (metrics); they must be cheap and must not raise."""

    def on_request_added(self, request_id: str, arrival_time: float) -> None: ...

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_request_aborted(self, request_id: str, now: float) -> None: ...


@dataclass
class EngineRequest:
    """One request to add: what LLMEngine.add_request takes."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass
class _Add:
    requests: list[EngineRequest]
    stream: RequestStream
    ack: asyncio.Future
    enqueued: float


@dataclass
class _Abort:
    request_ids: list[str]
    enqueued: float


class RequestStream:
    """Async iterator over the outputs of one or more engine requests, in the order produced.

    Iteration ends when all of them finished. Exceptions delivered by the engine loop (engine dead,
    aborted by the server) are raised from `__anext__`. `abort()` aborts what is unfinished.
    Outputs of a request that pile up before the consumer reads them are merged into one (deltas
    concatenated, cumulative outputs replaced), so a slow reader costs per read, not per token.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str], delta: bool = True) -> None:
        self._engine = engine
        self.request_ids = list(request_ids)
        self._unfinished = set(request_ids)
        self._delta = delta
        self._items: list[RequestOutput | BaseException | None] = []  # None: merged away
        self._head = 0
        self._pending: dict[str, int] = {}  # request id -> index of its unread output
        self._ready = asyncio.Event()

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        while self._head == len(self._items):
            self._ready.clear()
            await self._ready.wait()
        item = self._items[self._head]
        self._head += 1
        if self._head == len(self._items):
            self._items.clear()
            self._head = 0
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        self._pending.pop(item.request_id, None)
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def abort(self) -> None:
        """Abort every request of this stream that has not finished (idempotent, non-blocking)."""
        if self._unfinished:
            ids = sorted(self._unfinished)
            self._unfinished.clear()
            self._engine.abort(ids)

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            at = self._pending.get(item.request_id)
            if at is not None and at >= self._head:
                unread = self._items[at]
                self._items[at] = merge_outputs(unread, item) if self._delta else item
                return
            self._pending[item.request_id] = len(self._items)
        self._items.append(item)
        self._ready.set()


class AsyncEngine:
    """Runs `engine.step()` in a dedicated thread; all engine calls happen on that thread.

    The event loop talks to it through a thread-safe inbox (adds, aborts), processed between
    steps, and receives outputs through `loop.call_soon_threadsafe`, once per step.
    """

    def __init__(self, engine: Any, *, no_progress_timeout: float = 60.0,
                 observers: list[RequestObserver] | None = None) -> None:
        self.engine = engine
        self.config = engine.config
        # NOTE: HF fast tokenizers are not safe to use from two threads at once ("Already
        # borrowed"); the engine thread detokenizes, so the event loop gets its own copy.
        tok = getattr(engine, "tokenizer", None)
        self.tokenizer = copy.deepcopy(tok) if tok is not None else None
        self.no_progress_timeout = no_progress_timeout
        self.observers: list[RequestObserver] = list(observers or [])
        self._inbox: collections.deque[_Add | _Abort] = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # owned by the engine thread
        self._stats = EngineStats()
        self._dead_error: BaseException | None = None
        self._has_work = False
        self._last_progress = time.monotonic()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncEngine:
        """Build the LLMEngine from EngineArgs and wrap it.

        With CUDA the engine core gets its own process unless `engine_core_process` says no.
        """
        import dataclasses

        from peregrine.config import resolve_device
        from peregrine.engine.llm_engine import LLMEngine
        if args.engine_core_process is None:
            on_cuda = resolve_device(args.device).startswith("cuda")
            args = dataclasses.replace(args, engine_core_process=on_cuda)
        return cls(LLMEngine.from_engine_args(args), **kwargs)

    # ----------------------------------------------------------------- lifecycle (event loop)
    def start(self) -> None:
        """Start the engine thread; must be called from the event loop that will read outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="peregrine-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight end with RequestAbortedError."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead_error is None

    @property
    def stats(self) -> EngineStats:
        """The latest snapshot, refreshed by the engine thread after every step and when idle."""
        return self._stats

    def check_health(self) -> None:
        """Raise EngineDeadError if the loop died or made no progress for no_progress_timeout
        seconds while work was pending."""
        if self._dead_error is not None:
            raise EngineDeadError(f"engine loop died: {self._dead_error!r}")
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")
        now = time.monotonic()
        try:
            oldest = self._inbox[0].enqueued
        except IndexError:
            oldest = None
        if oldest is not None and now - oldest > self.no_progress_timeout:
            raise EngineDeadError(f"engine loop has not taken new work for {now - oldest:.1f}s")
        if self._has_work and now - self._last_progress > self.no_progress_timeout:
            raise EngineDeadError(
                f"engine made no progress for {now - self._last_progress:.1f}s with work pending")

    # ----------------------------------------------------------------- requests (event loop)
    async def add_requests(self, requests: list[EngineRequest]) -> RequestStream:
        """Add requests atomically (all or none) and return their shared stream.

        Raises ValueError (bad input), QueueFullError (a ValueError), or
        EngineDeadError; nothing is left in the engine when it raises.
        """
        if self._dead_error is not None or self._thread is None:
            raise EngineDeadError("engine loop is not running")
        assert self._loop is not None
        for r in requests:
            if r.params.structured_outputs is not None:
                # NOTE: compiled off the engine thread (and the event loop): the add hits the cache.
                await asyncio.to_thread(self.engine.compile_structure, r.params.structured_outputs)
        delta = all(r.params.output_kind == RequestOutputKind.DELTA for r in requests)
        stream = RequestStream(self, [r.request_id for r in requests], delta)
        ack: asyncio.Future = self._loop.create_future()
        self._push(_Add(requests, stream, ack, time.monotonic()))
        try:
            await ack
        except asyncio.CancelledError:
            # NOTE: the add may still succeed on the engine thread; the abort is queued behind it.
            stream.abort()
            raise
        return stream

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0) -> RequestStream:
        """Add one request; see add_requests."""
        return await self.add_requests([EngineRequest(request_id, prompt, params, priority)])

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0):
        """Yield RequestOutputs of one request; closing the generator early aborts it."""
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_ids: str | list[str]) -> None:
        """Queue an abort; the engine frees the requests' KV blocks before its next step."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if ids:
            self._push(_Abort(ids, time.monotonic()))

    def _push(self, item: _Add | _Abort) -> None:
        self._inbox.append(item)
        self._wake.set()
        wake_engine = getattr(self.engine, "wake", None)
        if wake_engine is not None:
            wake_engine()  # a step waiting on the core returns, so the inbox is read now

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        failures = 0
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._has_work = False
                    self._stats = self.engine.get_stats()
                    self._wake.wait(timeout=0.5)
                    continue
                if not self._has_work:
                    # NOTE: the clock restarts before the flag flips, so /health never pairs
                    # "work pending" with an idle period's old timestamp.
                    self._last_progress = time.monotonic()
                    self._has_work = True
                prev = self._stats
                try:
                    outputs = self.engine.step()
                except EngineCoreDeadError:
                    raise
                except Exception as e:  # noqa: BLE001 - one bad step must not kill the server
                    failures += 1
                    logger.exception("engine step failed (%d in a row)", failures)
                    if failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
                        raise
                    self._fail_all(RequestAbortedError(f"engine step failed: {e!r}"))
                    continue
                failures = 0
                now = time.monotonic()
                stats = self.engine.get_stats()
                self._stats = stats
                if outputs or (stats.prompt_tokens_total, stats.generation_tokens_total) != (
                        prev.prompt_tokens_total, prev.generation_tokens_total):
                    self._last_progress = now
                self._dispatch(outputs, now)
        except BaseException as e:  # noqa: BLE001
            logger.exception("engine loop died")
            self._dead_error = e
            self._fail_all(EngineDeadError(f"engine loop died: {e!r}"), abort_in_engine=False)
            self._reject_inbox(EngineDeadError(f"engine loop died: {e!r}"))
            return
        self._fail_all(ServerShuttingDownError("server is shutting down"))
        self._reject_inbox(EngineDeadError("engine is shut down"))
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def _drain_inbox(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, _Abort):
                self._process_abort(item.request_ids)
            else:
                self._process_add(item)

    def _process_add(self, item: _Add) -> None:
        added: list[str] = []
        try:
            for r in item.requests:
                self.engine.add_request(r.request_id, r.prompt, r.params,
                                        arrival_time=r.arrival_time, priority=r.priority)
                added.append(r.request_id)
        except Exception as e:  # noqa: BLE001 - the caller gets the error, the loop goes on
            if added:
                try:
                    self.engine.abort_request(added)
                except Exception:  # noqa: BLE001
                    logger.exception("could not roll back a partly added request group")
            self._call_soon(_settle, item.ack, e)
            return
        for rid in added:
            self._streams[rid] = item.stream
        # NOTE: observers learn of the request in the same FIFO of callbacks that will carry
        # its outputs, so they always see the add before the first output.
        self._call_soon(self._notify_added, item.requests)
        self._call_soon(_settle, item.ack, None)

    def _process_abort(self, request_ids: list[str]) -> None:
        # NOTE: each aborted request's stream ends with its final output (finish_reason "abort"),
        # so a consumer that did not abort it itself still sees the end.
        finals = self.engine.abort_request(request_ids) or []
        self._dispatch(finals, time.monotonic())
        aborted = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
        if aborted:
            self._call_soon(self._notify_aborted, aborted, time.monotonic())

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        batch: list[tuple[RequestStream, RequestOutput]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile, or not ours
            if out.finished:
                del self._streams[out.request_id]
            batch.append((stream, out))
        if batch:
            self._call_soon(self._deliver, batch, now)

    def _fail_all(self, error: BaseException, abort_in_engine: bool = True) -> None:
        if not self._streams:
            return
        ids = list(self._streams)
        streams = {id(s): s for s in self._streams.values()}
        self._streams.clear()
        if abort_in_engine:
            try:
                self.engine.abort_request(ids)
            except Exception:  # noqa: BLE001
                logger.exception("aborting requests after a failure also failed")
        self._call_soon(self._deliver_error, list(streams.values()), error, ids, time.monotonic())

    def _reject_inbox(self, error: BaseException) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, _Add):
                self._call_soon(_settle, item.ack, error)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    # ----------------------------------------------------------------- callbacks (event loop)
    def _deliver(self, batch: list[tuple[RequestStream, RequestOutput]], now: float) -> None:
        for stream, out in batch:
            stream._put(out)
        outs = [out for _, out in batch]
        for obs in self.observers:
            obs.on_outputs(outs, now)

    def _deliver_error(self, streams: list[RequestStream], error: BaseException,
                       request_ids: list[str], now: float) -> None:
        for stream in streams:
            stream._put(error)
        self._notify_aborted(request_ids, now)

    def _notify_added(self, requests: list[EngineRequest]) -> None:
        for obs in self.observers:
            for r in requests:
                obs.on_request_added(r.request_id, r.arrival_time)

    def _notify_aborted(self, request_ids: list[str], now: float) -> None:
        for obs in self.observers:
            for rid in request_ids:
                obs.on_request_aborted(rid, now)


def _settle(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():
        return  # the caller was cancelled
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
