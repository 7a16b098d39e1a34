"""MultiprocExecutor: one spawned worker process per rank, tensor_parallel_size x
pipeline_parallel_size of them (NCCL on CUDA, gloo on the CPU); the scheduler stays in the driver.

Rank = pp_rank * tensor_parallel_size + tp_rank (distributed.py): each pipeline stage's ranks
form its tensor-parallel group, and a stage hands its hidden states to the next one's ranks.

Each step's SchedulerOutput is pickled once and broadcast through a shared-memory ring
(shm_broadcast.py) to every rank of every stage; a one-byte notice down each worker's pipe says a
message is there. Every rank keeps the same batch state. The last stage's ranks sample the same
tokens (the LM head gathers the full logits on every rank, the sampler's noise is keyed on seed
and position); its first rank sends the ModelRunnerOutput back, the other ranks send only errors.
The driver waits on the result pipes and the processes' sentinels together, so a dead worker is
noticed at once.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from peregrine.config import EngineConfig
from peregrine.executor.base import Executor, NumberedStepFuture, WorkerFailedError
from peregrine.executor.shm_broadcast import ShmRing
from peregrine.executor.worker_setup import (build_worker, choose_num_blocks, describe_rank,
                                             output_rank, rank_device, rank_tag)
from peregrine.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("peregrine")
_JOIN_S = 5.0  # a worker asked to stop is killed after this long
_SPIN_S = 2e-4  # a worker polls its launched step's event this often while no step is queued
_STEP, _INIT, _QUIT = b"s", b"i", b"q"  # notices down a worker's pipe
_STATS = b"t"  # + b"1" to reset: the worker answers with its pipeline stage's timers


@dataclass
class _Workers:
    """What shutting the workers down needs (the finalizer must not hold the executor)."""

    procs: list[multiprocessing.process.BaseProcess] = field(default_factory=list)
    cmd: list[multiprocessing.connection.Connection] = field(default_factory=list)
    res: list[multiprocessing.connection.Connection] = field(default_factory=list)
    ring: ShmRing | None = None
    store: Any = None
    closed: bool = False


def _stop_workers(w: _Workers, graceful: bool = True) -> None:
    """Ask the workers to exit, kill what is left, free the ring. Safe to call twice."""
    if w.closed:
        return
    w.closed = True
    if graceful:
        for conn in w.cmd:
            try:
                conn.send_bytes(_QUIT)
            except OSError:
                pass
        deadline = time.monotonic() + _JOIN_S
        for p in w.procs:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in w.procs:
        if p.is_alive():
            p.kill()
    for p in w.procs:
        p.join(_JOIN_S)
    for conn in w.cmd + w.res:
        conn.close()
    if w.ring is not None:
        w.ring.close()
    w.store = None


@contextmanager
def _may_start_children():
    # NOTE: the engine core's own process is daemonic, and multiprocessing refuses children to a
    # daemonic process. The workers are daemonic too and are stopped (or killed) with it.
    proc = multiprocessing.current_process()
    was = proc.daemon
    proc._config["daemon"] = False  # noqa: SLF001
    try:
        yield
    finally:
        proc._config["daemon"] = was  # noqa: SLF001


class MultiprocExecutor(Executor):
    """tensor_parallel_size x pipeline_parallel_size worker processes on one host; rank r runs on
    cuda:r or the CPU."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        import torch.distributed as dist

        world = config.world_size
        ctx = multiprocessing.get_context("spawn")
        self._w = w = _Workers()
        self._finalizer = weakref.finalize(self, _stop_workers, w, False)
        self._error: str | None = None
        self._outputs: dict[int, ModelRunnerOutput] = {}
        self._num_sent = 0
        try:
            # The rendezvous: a store the driver hosts on a free port, so ranks never race for one.
            w.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            w.ring = ShmRing(world)
            level = logger.getEffectiveLevel()
            for rank in range(world):
                cmd_r, cmd_w = ctx.Pipe(duplex=False)
                res_r, res_w = ctx.Pipe(duplex=False)
                p = ctx.Process(target=run_worker, name=f"peregrine-rank{rank}", daemon=True,
                                args=(config, rank, w.store.port, w.ring.spec(), cmd_r, res_w,
                                      level))
                with _may_start_children():
                    p.start()
                cmd_r.close()
                res_w.close()
                w.procs.append(p)
                w.cmd.append(cmd_w)
                w.res.append(res_r)
            sized = self._gather("sized")
            self.num_blocks = choose_num_blocks(config, sized)
            self.weight_bytes = sum(info["weight_bytes"] for info in sized)
            for conn in w.cmd:
                conn.send_bytes(_INIT + self.num_blocks.to_bytes(8, "little"))
            self._gather("ready")
        except BaseException:
            _stop_workers(w, graceful=False)
            raise

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids, by rank."""
        return [p.pid for p in self._w.procs]

    @property
    def ring_name(self) -> str | None:
        """The shared-memory segment the steps are broadcast through."""
        return None if self._w.ring is None else self._w.ring.name

    # ---- the step ---------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> NumberedStepFuture:
        """Broadcast the step to every worker; return without waiting for it."""
        self._poll(0.0)  # raises if a worker failed
        data = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        seq = self._num_sent
        self._num_sent += 1
        self._w.ring.write(data, notify=self._notify, wait=lambda: self._poll(0.0))
        return NumberedStepFuture(self, seq)

    def _notify(self, notice: bytes = _STEP) -> None:
        for rank, conn in enumerate(self._w.cmd):
            try:
                conn.send_bytes(notice)
            except OSError:
                self._fail(f"{describe_rank(self.config, rank)} is gone (its pipe is closed)")

    def stage_stats(self, reset: bool = False) -> list[dict[str, float]]:
        """Per rank (pipeline parallelism): steps, busy and idle time of its stage since the last
        reset (worker/stage_io.py); [] without pipeline stages. Waits for the steps sent."""
        if self.config.pipeline_parallel_size == 1:
            return []
        self._poll(0.0)
        self._notify(_STATS + (b"1" if reset else b"0"))
        return self._gather("stats")

    def _result_of(self, seq: int) -> ModelRunnerOutput:
        while seq not in self._outputs:
            self._poll(None)
        return self._outputs.pop(seq)

    def check_health(self) -> None:
        self._poll(0.0)

    def shutdown(self) -> None:
        self._finalizer()
        if self._error is None:
            self._error = "the executor is shut down"

    # ---- messages from the workers ----------------------------------------------------------
    def _poll(self, timeout: float | None) -> list[tuple[int, str, Any]]:
        """Read what the workers sent (waiting up to `timeout`, None: until something comes);
        keeps step outputs, returns other messages as (rank, kind, payload); raises
        WorkerFailedError on an error message or a dead worker."""
        if self._error is not None:
            raise WorkerFailedError(self._error)
        w = self._w
        sentinels = {p.sentinel: rank for rank, p in enumerate(w.procs)}
        ready = multiprocessing.connection.wait(w.res + list(sentinels), timeout)
        got: list[tuple[int, str, Any]] = []
        errors: list[str] = []
        for obj in ready:
            if obj in sentinels:
                continue
            rank = w.res.index(obj)
            while obj.poll(0):
                try:
                    kind, payload = obj.recv()
                except (EOFError, OSError):
                    break  # it exited: its sentinel says how
                if kind == "out":
                    seq, out = payload
                    self._outputs[seq] = out
                elif kind == "error":
                    errors.append(f"{describe_rank(self.config, rank)} failed: {payload}")
                else:
                    got.append((rank, kind, payload))
        exits: list[str] = []
        for obj in ready:
            if obj in sentinels:
                rank = sentinels[obj]
                p = w.procs[rank]
                p.join(1.0)  # NOTE: the exit code is known only once the process is reaped
                reason = (f"{describe_rank(self.config, rank)} (pid {p.pid}) exited "
                          f"unexpectedly with exit code {p.exitcode}")
                if p.exitcode != 0:  # killed or crashed: its peers' errors follow from it
                    self._fail(reason)
                exits.append(reason)
        if errors or exits:
            self._fail((errors + exits)[0])
        return got

    def _fail(self, reason: str) -> None:
        self._error = reason
        logger.error("%s; stopping every worker", reason)
        _stop_workers(self._w, graceful=False)
        raise WorkerFailedError(reason)

    def _gather(self, kind: str) -> list[Any]:
        """One `kind` message from every rank, in rank order."""
        got: dict[int, Any] = {}
        while len(got) < self.world_size:
            for rank, k, payload in self._poll(None):
                if k != kind:
                    self._fail(f"{describe_rank(self.config, rank)} sent {k!r}, expected "
                               f"{kind!r}")
                got[rank] = payload
        return [got[r] for r in range(self.world_size)]


# ---- the worker process ---------------------------------------------------------------------
def run_worker(config: EngineConfig, rank: int, store_port: int, ring_spec: tuple, cmd, res,
               log_level: int = logging.INFO) -> None:
    """A worker process: join the group, load the shard, size the KV cache, then run steps."""
    # NOTE: Ctrl-C reaches the whole process group; the driver decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s "
                                                f"({rank_tag(config, rank)}): %(message)s")
    try:
        _serve(config, rank, store_port, ring_spec, cmd, res)
    except (EOFError, BrokenPipeError):
        pass  # the driver is gone
    except BaseException as e:  # noqa: BLE001 - the driver reports it
        logger.exception("worker failed")
        try:
            res.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
    # NOTE: exit without the process group's C++ teardown, which can abort or wait on a peer
    # that is already gone; the driver decides when the workers stop.
    os._exit(0)


def _serve(config: EngineConfig, rank: int, store_port: int, ring_spec: tuple, cmd, res) -> None:
    import torch.distributed as dist

    device = rank_device(config, local_rank=rank, ranks_on_host=config.world_size)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    worker, sized = build_worker(config, rank, rank, store, device)
    res.send(("sized", sized))
    notice = cmd.recv_bytes()
    if notice[:1] != _INIT:
        return
    worker.initialize_cache(int.from_bytes(notice[1:9], "little"))
    res.send(("ready", None))
    ring = ShmRing.attach(ring_spec)
    parent = os.getppid()

    def driver_alive() -> None:
        if os.getppid() != parent:
            raise EOFError("the driver exited")

    try:
        _step_loop(worker, ring, rank == output_rank(config), cmd, res, driver_alive)
    finally:
        ring.close()


def _step_loop(worker, ring: ShmRing, returns_output: bool, cmd, res, driver_alive) -> None:
    """Launch each step as it comes; collect a launched step once the next one is queued behind
    it on the device, or once the device is done with it (so the device never waits for us)."""
    pending = None  # (seq, handle) launched, not collected
    seq = 0
    while True:
        if pending is not None and not cmd.poll(0):
            handle = pending[1]
            if handle.event is not None and not handle.event.query():
                cmd.poll(_SPIN_S)
                continue
            _collect(worker, pending, returns_output, res)
            pending = None
            continue
        notice = cmd.recv_bytes()
        if notice[:1] == _STATS:
            if pending is not None:
                _collect(worker, pending, returns_output, res)
                pending = None
            res.send(("stats", worker.model_runner.stage_stats(reset=notice[1:2] == b"1")))
            continue
        if notice != _STEP:
            return  # _QUIT
        sched = pickle.loads(ring.read(worker.rank, wait=driver_alive))
        handle = worker.execute_model(sched)
        if pending is not None:
            _collect(worker, pending, returns_output, res)
        pending = (seq, handle)
        seq += 1


def _collect(worker, pending: tuple, returns_output: bool, res) -> None:
    seq, handle = pending
    out = worker.collect(handle)
    if returns_output:
        res.send(("out", (seq, out)))
