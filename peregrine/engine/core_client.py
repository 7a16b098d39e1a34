"""How the front end reaches the engine core: a direct call, or a socket to the core's own process.

In its own process the core steps as fast as the device allows while the front end (the API
server's event loop, detokenizing, streaming) runs in another interpreter, so neither waits for
the other's Python. Messages are pickled dataclasses; outputs come one message per core step.
"""
from __future__ import annotations

import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import socket
import threading
import time
import traceback
import weakref
from typing import Protocol

from peregrine import envs
from peregrine.config import EngineConfig
from peregrine.engine.core import EngineCore, EngineCoreOutputs, EngineCoreRequest, FinishedInfo
from peregrine.engine.pacing import LaunchPacer
from peregrine.engine.request import RequestStatus

logger = logging.getLogger("peregrine")

_STARTUP_TIMEOUT_S = 1800.0  # loading a large checkpoint and capturing graphs takes minutes
_POLL_S = 0.05  # how long get_outputs waits for the next step before returning nothing


class EngineCoreDeadError(RuntimeError):
    """The engine core's process has exited; nothing more can be served."""


class CoreClient(Protocol):
    """What the front end needs of a core, wherever it runs."""

    def add_requests(self, requests: list[EngineCoreRequest]) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def get_outputs(self) -> list[EngineCoreOutputs]: ...

    def wake(self) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


def make_core_client(config: EngineConfig) -> CoreClient:
    """The core in its own process when `engine_core_process` is set, else in this one."""
    return ProcessCoreClient(config) if config.engine_core_process else InprocCoreClient(config)


def freeze_startup_heap() -> None:
    """Leave what exists now (modules, model, block pool: it lives as long as the engine) out of
    every later garbage collection. Unfrozen, a full collection rescans it all: at high
    concurrency that cost milliseconds per step, and an offline batch that makes enough
    long-lived objects paid ~0.1 s once mid-run (the Qwen3-0.6B throughput run on an H200)."""
    gc.collect()
    gc.freeze()


def freezes_heap(config: EngineConfig) -> bool:
    """Whether an engine core in this process freezes the start-up heap (on CUDA)."""
    return str(config.device).startswith("cuda")


class InprocCoreClient:
    """The core in this process: each get_outputs() runs one core step.

    On a GPU the start-up heap is frozen (freeze_startup_heap) until the client shuts down or is
    dropped; then it is unfrozen, so a dropped engine's reference cycles can be collected. CPU
    engines (tests, mostly, many to a process) skip it: the collection before freezing costs
    0.1-0.4 s each there."""

    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self._unfreeze: weakref.finalize | None = None
        if freezes_heap(config):
            freeze_startup_heap()
            self._unfreeze = weakref.finalize(self, gc.unfreeze)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        added: list[str] = []
        try:
            for r in requests:
                self.core.add_request(r)
                added.append(r.request_id)
        except Exception:
            self.core.abort_requests(added)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_outputs(self) -> list[EngineCoreOutputs]:
        return [self.core.step()] if self.core.has_work() else []

    def wake(self) -> None:
        """Nothing to do: get_outputs never waits here."""

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def check_health(self) -> None:
        self.core.check_health()

    def shutdown(self) -> None:
        self.core.shutdown()
        if self._unfreeze is not None:
            self._unfreeze()


class _PipeSender:
    """Sends messages on a pipe from a thread of its own, batching what queued up meanwhile.

    NOTE: neither side ever blocks on a full pipe while the other waits to send to it: each end
    hands its sends to a thread like this and keeps reading.
    """

    def __init__(self, conn, name: str) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, msg: tuple) -> None:
        self._queue.put(msg)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            batch = [m for m in batch if m is not None]
            try:
                if batch:
                    self._conn.send(batch)
            except (BrokenPipeError, OSError) as e:
                self.error = e
                return
            if stop:
                return


class ProcessCoreClient:
    """The core in a child process, reached through two pipes (requests in, step outputs out)."""

    def __init__(self, config: EngineConfig, wait: bool = True) -> None:
        """Spawn the core; with wait=False the caller calls wait_ready() before using it (so
        its own start-up work overlaps the core's)."""
        # NOTE: spawn, not fork: the child initialises CUDA, which a forked child cannot.
        ctx = multiprocessing.get_context("spawn")
        to_core_r, self._to_core = ctx.Pipe(duplex=False)
        self._from_core, from_core_w = ctx.Pipe(duplex=False)
        level = logging.getLogger("peregrine").getEffectiveLevel()
        self._proc = ctx.Process(target=run_engine_core,
                                 args=(config, to_core_r, from_core_w, level),
                                 name="peregrine-engine-core", daemon=True)
        self._proc.start()
        to_core_r.close()
        from_core_w.close()
        self._closed = False
        self._sender = _PipeSender(self._to_core, "peregrine-core-sender")
        # NOTE: wake() cuts get_outputs' wait short, so new requests go out at once, not after
        # the core's next step.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the core process says it is ready; on failure shut it down and raise."""
        if not self._from_core.poll(_STARTUP_TIMEOUT_S):
            self.shutdown()
            raise EngineCoreDeadError("the engine core did not start in time")
        (kind, payload), = self._recv()
        if kind != "ready":
            self.shutdown()
            raise ValueError(f"the engine core failed to start: {payload}")

    def _dead(self) -> EngineCoreDeadError:
        return EngineCoreDeadError(
            f"the engine core process exited (exit code {self._proc.exitcode})")

    def _recv(self) -> list[tuple]:
        try:
            return self._from_core.recv()
        except (EOFError, OSError) as e:
            raise self._dead() from e

    def _send(self, msg: tuple) -> None:
        if self._sender.error is not None:
            raise self._dead() from self._sender.error
        self._sender.put(msg)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        # NOTE: fire and forget: a request the core refuses comes back finished with its error.
        self._send(("add", requests))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(("abort", request_ids))

    def wake(self) -> None:
        """Make a get_outputs() waiting in another thread return now (thread-safe)."""
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake, or closed

    def get_outputs(self) -> list[EngineCoreOutputs]:
        """Every step output that arrived (waits a short poll for the first, or until woken)."""
        ready = multiprocessing.connection.wait([self._from_core, self._wake_r], _POLL_S)
        if self._wake_r in ready:
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        if self._from_core not in ready:
            return []
        outs: list[EngineCoreOutputs] = []
        while True:
            for kind, payload in self._recv():
                if kind == "error":
                    raise EngineCoreDeadError(f"the engine core failed: {payload}")
                outs.append(payload)
            if not self._from_core.poll(0):
                return outs

    def reset_prefix_cache(self) -> None:
        self._send(("reset_prefix_cache", None))

    def check_health(self) -> None:
        if not self._proc.is_alive() or self._sender.error is not None:
            raise self._dead()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._sender.put(("shutdown", None))
        self._sender.close()
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
        self._to_core.close()
        self._from_core.close()
        self._wake_r.close()
        self._wake_w.close()


def run_engine_core(config: EngineConfig, inbox, outbox, log_level: int = logging.INFO) -> None:
    """The core process: build the core, then step while there is work, reading requests between
    steps; exits on `shutdown` or when the front end goes away."""
    # NOTE: a spawned process starts with no logging set up; log as the front end does.
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - the front end reports it
        outbox.send([("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")])
        return
    freeze_startup_heap()
    sender = _PipeSender(outbox, "peregrine-core-outputs")
    sender.put(("ready", core.executor.num_blocks))
    parent = os.getppid()
    pacer = LaunchPacer() if envs.core_pacing() else None
    try:
        serve_core(core, inbox, sender, pacer, lambda: os.getppid() != parent)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    except BaseException as e:  # noqa: BLE001
        logger.exception("engine core died")
        sender.put(("error", f"{type(e).__name__}: {e}"))
    finally:
        sender.close()
        core.shutdown()


def serve_core(core: EngineCore, inbox, sender, pacer: LaunchPacer | None,
               orphaned=lambda: False) -> None:
    """The core process's loop: step while there is work, reading requests between steps (and,
    with a pacer, while the device works); returns on `shutdown` or when orphaned() says the
    front end is gone. inbox: poll(timeout) and recv() as a pipe's; sender: put() and error."""
    while sender.error is None:
        if not core.has_work() and not inbox.poll(1.0):
            if orphaned():
                return  # the front end died without a shutdown
            continue
        refused = EngineCoreOutputs()
        while inbox.poll():
            for kind, payload in inbox.recv():
                if kind == "shutdown":
                    return
                _handle(core, kind, payload, refused)
        stepped = core.has_work()
        out = core.step() if stepped else EngineCoreOutputs()
        out.finished.update(refused.finished)
        if out:
            sender.put(("outputs", out))
        if stepped:
            # NOTE: a dead worker fails its step's requests (sent above), then ends the core:
            # the front end's health check then fails too.
            core.check_health()
        if pacer is not None and stepped:
            _listen(core, pacer, inbox)


def _listen(core: EngineCore, pacer: LaunchPacer, inbox) -> None:
    """While the device works on the step in flight, wait for new requests for as long as the
    pacer allows, so one that arrives meanwhile joins the next step (see engine/pacing.py)."""
    pacer.observe(core.last_device_wait)
    budget = pacer.budget() if core.pipeline.busy else 0.0
    if budget > 0.0:
        t0 = time.perf_counter()
        inbox.poll(budget)
        pacer.listened(time.perf_counter() - t0)


def _handle(core: EngineCore, kind: str, payload, refused: EngineCoreOutputs) -> None:
    if kind == "add":
        for r in payload:
            try:
                core.add_request(r)
            except ValueError as e:  # e.g. the waiting queue is full
                refused.finished[r.request_id] = FinishedInfo(RequestStatus.FINISHED_ERROR,
                                                              None, str(e))
    elif kind == "abort":
        core.abort_requests(payload)
    elif kind == "reset_prefix_cache":
        core.reset_prefix_cache()
    else:
        raise ValueError(f"unknown message to the engine core: {kind!r}")

