"""How the front end reaches the engine core: a direct call, or a socket to the core's own process.

In its own process the core steps as fast as the device allows while the front end (the API
server's event loop, detokenizing, streaming) runs in another interpreter, so neither waits for
the other's Python. Messages are pickled dataclasses; outputs come one message per core step.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import traceback
from typing import Protocol

from peregrine.config import EngineConfig
from peregrine.engine.core import EngineCore, EngineCoreOutputs, EngineCoreRequest, FinishedInfo
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

    def reset_prefix_cache(self) -> None: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


def make_core_client(config: EngineConfig) -> CoreClient:
    """The core in its own process when `engine_core_process` is set, else in this one."""
    return ProcessCoreClient(config) if config.engine_core_process else InprocCoreClient(config)


class InprocCoreClient:
    """The core in this process: each get_outputs() runs one core step."""

    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)

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

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def check_health(self) -> None:
        self.core.check_health()

    def shutdown(self) -> None:
        self.core.shutdown()


class ProcessCoreClient:
    """The core in a child process, reached through two pipes (requests in, step outputs out)."""

    def __init__(self, config: EngineConfig) -> None:
        # NOTE: spawn, not fork: the child initialises CUDA, which a forked child cannot.
        ctx = multiprocessing.get_context("spawn")
        to_core_r, self._to_core = ctx.Pipe(duplex=False)
        self._from_core, from_core_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=run_engine_core, args=(config, to_core_r, from_core_w),
                                 name="peregrine-engine-core", daemon=True)
        self._proc.start()
        to_core_r.close()
        from_core_w.close()
        self._closed = False
        if not self._from_core.poll(_STARTUP_TIMEOUT_S):
            self.shutdown()
            raise EngineCoreDeadError("the engine core did not start in time")
        kind, payload = self._recv()
        if kind != "ready":
            self.shutdown()
            raise ValueError(f"the engine core failed to start: {payload}")

    def _recv(self):
        try:
            return self._from_core.recv()
        except (EOFError, OSError) as e:
            raise EngineCoreDeadError(
                f"the engine core process exited (exit code {self._proc.exitcode})") from e

    def _send(self, msg: tuple) -> None:
        try:
            self._to_core.send(msg)
        except (BrokenPipeError, OSError) as e:
            raise EngineCoreDeadError(
                f"the engine core process exited (exit code {self._proc.exitcode})") from e

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        # NOTE: fire and forget: a request the core refuses comes back finished with its error.
        self._send(("add", requests))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(("abort", request_ids))

    def get_outputs(self) -> list[EngineCoreOutputs]:
        """Every step output that arrived (waits up to a short poll for the first)."""
        if not self._from_core.poll(_POLL_S):
            return []
        outs: list[EngineCoreOutputs] = []
        while True:
            kind, payload = self._recv()
            if kind == "error":
                raise EngineCoreDeadError(f"the engine core failed: {payload}")
            outs.append(payload)
            if not self._from_core.poll(0):
                return outs

    def reset_prefix_cache(self) -> None:
        self._send(("reset_prefix_cache", None))

    def check_health(self) -> None:
        if not self._proc.is_alive():
            raise EngineCoreDeadError(
                f"the engine core process exited (exit code {self._proc.exitcode})")

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._to_core.send(("shutdown", None))
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
        self._to_core.close()
        self._from_core.close()


def run_engine_core(config: EngineConfig, inbox, outbox) -> None:
    """The core process: build the core, then step while there is work, reading requests between
    steps; exits on `shutdown` or when the front end goes away."""
    try:
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - the front end reports it
        outbox.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    outbox.send(("ready", core.executor.num_blocks))
    parent = os.getppid()
    try:
        while True:
            if not core.has_work() and not inbox.poll(1.0):
                if os.getppid() != parent:
                    return  # orphaned: the front end died without a shutdown
                continue
            refused = EngineCoreOutputs()
            while inbox.poll():
                kind, payload = inbox.recv()
                if kind == "shutdown":
                    return
                _handle(core, kind, payload, refused)
            out = core.step() if core.has_work() else EngineCoreOutputs()
            out.finished.update(refused.finished)
            if out:
                outbox.send(("outputs", out))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    except BaseException as e:  # noqa: BLE001
        logger.exception("engine core died")
        try:
            outbox.send(("error", f"{type(e).__name__}: {e}"))
        except (BrokenPipeError, OSError):
            pass
    finally:
        core.shutdown()


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

