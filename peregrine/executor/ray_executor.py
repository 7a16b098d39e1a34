"""RayExecutor: one Ray actor per rank, tensor_parallel_size x pipeline_parallel_size of them, on
the nodes of a Ray cluster (NCCL on CUDA, gloo on the CPU); the scheduler stays in the driver.

The driver joins the cluster it runs in (`ray start` on this node, or RAY_ADDRESS), else starts a
local Ray instance that it stops again at shutdown. A placement group reserves one bundle per rank
(a GPU each on CUDA, a CPU each on the CPU), packed onto as few nodes as possible; ranks on one node
are numbered together, the driver's node first, so a pipeline stage's ranks (rank = pp_rank x
tensor_parallel_size + tp_rank, worker_setup.py) share a node where they fit. Rank 0 hosts the
torch.distributed store on a port its node chooses, and every rank joins the group through it at
rank 0's node address.

Each step's SchedulerOutput is put into Ray's object store once and the reference is sent to every
actor (each node fetches it once). An actor launches each step as it arrives and collects the step
before it once the new one is queued behind it on the device; the output rank (the first of the
last pipeline stage, worker_setup.output_rank) keeps its outputs for the driver's `collect`. A
later stage's actor waits inside its step for the previous stage's hidden states, so up to
pipeline_parallel_size steps flow through the stages at once, as with the mp executor. The driver
watches every call in flight, so a rank that raises or dies fails the executor at the next wait,
with the rank in the message.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from peregrine.config import EngineConfig
from peregrine.executor.base import Executor, NumberedStepFuture, WorkerFailedError
from peregrine.executor.worker_setup import describe_rank, output_rank, rank_tag
from peregrine.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("peregrine")

RAY_INSTALL = "pip install 'peregrine-llm[ray]'"
_PLACEMENT_TIMEOUT_S = 300.0  # how long the cluster may take to free the ranks' bundles
_PROBE_S = 1.0  # check_health probes idle actors at most this often


def ray_missing() -> str | None:
    """Why the ray backend cannot run here (Ray is not installed), or None."""
    try:
        found = importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return f"the ray backend needs Ray, which is not installed: {RAY_INSTALL}"


def import_ray():
    """The `ray` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"the ray backend needs Ray, which cannot be imported ({e}): "
                          f"{RAY_INSTALL}") from e
    return ray


# ---- the actor ------------------------------------------------------------------------------
class RayWorker:
    """One rank inside a Ray actor: the same Worker the other executors run."""

    def __init__(self, config: EngineConfig, rank: int, log_level: int = logging.INFO) -> None:
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s "
                                                    f"({rank_tag(config, rank)}): %(message)s")
        self.config = config
        self.rank = rank
        self._returns_output = rank == output_rank(config)  # it keeps its steps' outputs
        self.worker = None
        self._store = None
        self._pending = None  # (seq, StepHandle) launched, not collected
        self._outputs: dict[int, ModelRunnerOutput] = {}

    def placement(self) -> dict[str, Any]:
        """Where this actor runs: node id and address, its GPUs (as Ray numbers them), pid."""
        import ray
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def host_store(self) -> int:
        """Host the group's rendezvous store on a free port of this node; return the port."""
        import torch.distributed as dist
        self._store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        return self._store.port

    def start(self, store_ip: str, store_port: int, local_rank: int, ranks_on_host: int,
              visible_devices: str | None) -> dict[str, Any]:
        """Join the group, load the shard and size the KV cache (worker_setup.build_worker)."""
        if visible_devices is not None:
            # NOTE: Ray shows each actor only its own GPU; the node's ranks see all of theirs, so
            # NCCL can find the peer-to-peer paths between them. Set before CUDA starts.
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        import torch.distributed as dist

        from peregrine.executor.worker_setup import build_worker, rank_device
        device = rank_device(self.config, local_rank, ranks_on_host)
        store = self._store or dist.TCPStore(store_ip, store_port, is_master=False)
        self.worker, sized = build_worker(self.config, self.rank, local_rank, store, device)
        import ray
        sized["device"] = f"{sized['device']} at {ray.util.get_node_ip_address()}"
        return sized

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, seq: int, sched: SchedulerOutput) -> None:
        """Launch step `seq`, then collect the step before it (queued ahead of it)."""
        handle = self.worker.execute_model(sched)
        if self._pending is not None:
            self._collect_pending()
        self._pending = (seq, handle)

    def collect(self, seq: int) -> ModelRunnerOutput:
        """Step `seq`'s output (waits for the device if the step is still pending)."""
        if seq not in self._outputs:
            if self._pending is None or self._pending[0] != seq:
                raise RuntimeError(f"step {seq} was not launched on rank {self.rank}")
            self._collect_pending()
        return self._outputs.pop(seq)

    def stage_stats(self, reset: bool = False) -> dict[str, float]:
        """This rank's pipeline-stage timers (ModelRunner.stage_stats), its pending step in."""
        if self._pending is not None:
            self._collect_pending()
        return self.worker.model_runner.stage_stats(reset)

    def ping(self) -> None:
        """Answer once every call queued before it has run (check_health's liveness probe)."""

    def _collect_pending(self) -> None:
        seq, handle = self._pending
        self._pending = None
        out = self.worker.collect(handle)
        if self._returns_output:
            self._outputs[seq] = out


# ---- the driver -----------------------------------------------------------------------------
@dataclass
class _Actors:
    """What releasing the actors needs (the finalizer must not hold the executor)."""

    actors: list = field(default_factory=list)
    placement_group: Any = None
    owns_ray: bool = False  # this driver started the Ray instance


def _release(a: _Actors, stop_ray: bool) -> None:
    """Kill the actors, remove the placement group and, with `stop_ray`, stop the Ray instance
    this driver started. Safe to call twice."""
    import ray
    if ray.is_initialized():
        for actor in a.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if a.placement_group is not None:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(a.placement_group)
            except Exception:  # noqa: BLE001 - already removed
                pass
    a.actors = []
    a.placement_group = None
    if stop_ray and a.owns_ray:
        a.owns_ray = False
        ray.shutdown()


class RayExecutor(Executor):
    """tensor_parallel_size x pipeline_parallel_size Ray actors, on one node or several; each rank
    on a GPU of its own."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        ray = import_ray()
        self._output_rank = output_rank(config)
        self._a = a = _Actors()
        self._finalizer = weakref.finalize(self, _release, a, True)
        self._error: str | None = None
        self._calls: dict[Any, tuple[int, str]] = {}  # ObjectRef in flight -> (rank, method)
        self._pinging: set[int] = set()
        self._last_sent = 0.0  # when every actor was last sent a call (a step or a probe)
        self._num_sent = 0
        try:
            a.owns_ray = _connect(ray, config)
            self._start(ray, config)
        except BaseException:
            self._finalizer()
            raise

    def _start(self, ray, config: EngineConfig) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from peregrine.executor.worker_setup import choose_num_blocks
        a, world = self._a, config.world_size
        on_cuda = config.device.startswith("cuda")
        a.placement_group, bundle_of_rank = _reserve(ray, world, on_cuda)
        remote = ray.remote(RayWorker)
        res = {"num_gpus": 1, "num_cpus": 0} if on_cuda else {"num_cpus": 1}
        level = logger.getEffectiveLevel()
        for rank, bundle in enumerate(bundle_of_rank):
            strategy = PlacementGroupSchedulingStrategy(a.placement_group, bundle)
            a.actors.append(remote.options(scheduling_strategy=strategy, max_restarts=0,
                                           **res).remote(config, rank, level))
        self._places = self._wait_for([self._call(r, "placement") for r in range(world)])
        port = self._wait_for([self._call(0, "host_store")])[0]
        ip = self._places[0]["ip"]
        sized = self._wait_for([self._call(r, "start", ip, port, *layout)
                                for r, layout in enumerate(local_layout(self._places, on_cuda))])
        self.num_blocks = choose_num_blocks(config, sized)
        self.weight_bytes = sum(info["weight_bytes"] for info in sized)
        self._wait_for([self._call(r, "initialize_cache", self.num_blocks) for r in range(world)])

    @property
    def worker_actors(self) -> list:
        """The actors' handles, by rank."""
        return list(self._a.actors)

    @property
    def worker_pids(self) -> list[int]:
        """The actors' process ids, by rank (on their own nodes)."""
        return [p["pid"] for p in self._places]

    @property
    def placement_group(self):
        """The placement group that holds the ranks' bundles (None once released)."""
        return self._a.placement_group

    # ---- the step ---------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> NumberedStepFuture:
        """Send the step to every actor (one object-store copy); return without waiting."""
        import ray
        self._harvest(0.0)  # raises if a worker failed
        ref = ray.put(scheduler_output)
        seq = self._num_sent
        self._num_sent += 1
        for rank in range(self.world_size):
            self._call(rank, "execute_model", seq, ref)
        self._last_sent = time.monotonic()
        return NumberedStepFuture(self, seq)

    def _result_of(self, seq: int) -> ModelRunnerOutput:
        if self._error is not None:
            raise WorkerFailedError(self._error)
        return self._wait_for([self._call(self._output_rank, "collect", seq)])[0]

    def stage_stats(self, reset: bool = False) -> list[dict[str, float]]:
        """Per rank (pipeline parallelism): its stage's steps, busy and idle time since the last
        reset; [] without pipeline stages. Waits for the steps sent."""
        if self.config.pipeline_parallel_size == 1:
            return []
        return self._wait_for([self._call(r, "stage_stats", reset)
                               for r in range(self.world_size)])

    def check_health(self) -> None:
        """Raise if a call failed or an actor died; never waits.

        A dead actor fails the next call sent to it, so while steps flow they are the probes;
        otherwise each actor is sent a no-op (at most every _PROBE_S), whose failure a later
        check sees.
        """
        self._harvest(0.0)
        now = time.monotonic()
        if self._pinging or now - self._last_sent < _PROBE_S:
            return
        self._last_sent = now
        for rank in range(self.world_size):
            self._pinging.add(rank)
            self._call(rank, "ping")

    def shutdown(self) -> None:
        self._finalizer()
        if self._error is None:
            self._error = "the executor is shut down"

    # ---- calls on the actors ----------------------------------------------------------------
    def _call(self, rank: int, method: str, *args) -> Any:
        if self._error is not None:
            raise WorkerFailedError(self._error)
        ref = getattr(self._a.actors[rank], method).remote(*args)
        self._calls[ref] = (rank, method)
        return ref

    def _wait_for(self, refs: list) -> list:
        """The results of these calls, in order, watching every call in flight meanwhile."""
        got: dict[Any, Any] = {}
        while True:
            got.update(self._harvest(0.0, want=refs))
            if all(r in got for r in refs):
                return [got[r] for r in refs]
            got.update(self._harvest(None, want=refs))

    def _harvest(self, timeout: float | None, want: list = ()) -> dict[Any, Any]:
        """Take the calls that finished (waiting up to `timeout` for one; None: until one does);
        return the results of those in `want`; raise WorkerFailedError on a failed call."""
        import ray
        if self._error is not None:
            raise WorkerFailedError(self._error)
        if not self._calls:
            return {}
        calls = list(self._calls)
        ready, _ = ray.wait(calls, num_returns=len(calls) if timeout == 0 else 1,
                            timeout=timeout, fetch_local=False)
        done, wanted, got = set(ready), set(want), {}
        failures: list[tuple[bool, str]] = []  # (an actor died, the line that says so)
        for ref in calls:  # in submission order: a step's error comes before its collect's
            if ref not in done:
                continue
            rank, method = self._calls.pop(ref)
            if method == "ping":
                self._pinging.discard(rank)
            try:
                value = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - any failure ends the executor
                failures.append((isinstance(e, ray.exceptions.RayActorError),
                                 _describe(ray, describe_rank(self.config, rank),
                                           self._place(rank), method, e)))
                continue
            if ref in wanted:
                got[ref] = value
        if failures:
            # NOTE: a dead actor is named before the errors its peers raise because of it (a
            # pipeline stage whose neighbour died fails its send or receive).
            self._fail(next((line for died, line in failures if died), failures[0][1]))
        return got

    def _place(self, rank: int) -> str:
        places = getattr(self, "_places", None)
        if not places:
            return "Ray actor"
        return f"Ray actor on {places[rank]['ip']}, pid {places[rank]['pid']}"

    def _fail(self, reason: str) -> None:
        self._error = reason
        logger.error("%s; stopping every worker", reason)
        _release(self._a, stop_ray=False)
        self._calls.clear()
        raise WorkerFailedError(reason)


def _describe(ray, who: str, where: str, method: str, e: Exception) -> str:
    """One line on a failed call of worker `who` (describe_rank): the worker's own exception, or
    how its actor died."""
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = e.cause if e.cause is not None else e
        return f"{who} failed: {type(cause).__name__}: {cause}"
    if isinstance(e, ray.exceptions.RayActorError):
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return (f"{who} ({where}) died during {method}: "
                f"{lines[0] if lines else type(e).__name__}")
    return f"{who} ({where}) failed: {type(e).__name__}: {e}"


def _connect(ray, config: EngineConfig) -> bool:
    """Join a running Ray cluster (this process's, RAY_ADDRESS's, or one `ray start` began on
    this node), else start a local instance. True: this driver started it and must stop it."""
    if ray.is_initialized():
        return False
    try:
        ray.init(address="auto")
        logger.info("connected to the Ray cluster at %s", ray.get_runtime_context().gcs_address)
        return False
    except ConnectionError:
        pass
    kw = {}
    if not config.device.startswith("cuda"):
        # NOTE: one CPU bundle per rank; a host with fewer cores still runs them (as mp does).
        kw["num_cpus"] = max(os.cpu_count() or 1, config.world_size)
    ray.init(include_dashboard=False, **kw)
    logger.info("started a local Ray instance for the workers (it stops with the engine; "
                "`ray start --head` first to run on a cluster)")
    return True


def _reserve(ray, world: int, on_cuda: bool) -> tuple[Any, list[int]]:
    """A placement group of one bundle per rank; returns it and each rank's bundle index (the
    driver's node first, then node by node)."""
    from ray.util.placement_group import placement_group, placement_group_table

    kind = "GPU" if on_cuda else "CPU"
    have = ray.cluster_resources().get(kind, 0)
    if have < world:
        raise RuntimeError(f"{world} ranks need {world} {kind}s, but the Ray cluster has "
                           f"{have:g} (`ray status` lists them; `ray start --address=HEAD:6379` "
                           f"adds a node)")
    pg = placement_group([{kind: 1} for _ in range(world)], strategy="PACK")
    ready, first_s = pg.ready(), min(5.0, _PLACEMENT_TIMEOUT_S)
    if not ray.wait([ready], timeout=first_s)[0]:
        logger.info("waiting up to %.0f s for the Ray cluster to free %d %ss for the workers",
                    _PLACEMENT_TIMEOUT_S, world, kind)
    try:
        ray.get(ready, timeout=_PLACEMENT_TIMEOUT_S - first_s)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group
        remove_placement_group(pg)
        raise RuntimeError(f"the Ray cluster did not free {world} {kind}s for the workers within "
                           f"{_PLACEMENT_TIMEOUT_S:.0f} s (`ray status` shows what holds "
                           f"them)") from None
    nodes = placement_group_table(pg)["bundles_to_node_id"]  # bundle index -> node id
    return pg, rank_order([nodes[b] for b in range(world)], ray.get_runtime_context().get_node_id())


def rank_order(bundle_nodes: list[str], driver_node: str) -> list[int]:
    """Bundle index of each rank: bundles on the driver's node first, then node by node (in order
    of first bundle), so the ranks of one node are consecutive."""
    first: dict[str, int] = {}
    for b, node in enumerate(bundle_nodes):
        first.setdefault(node, b)
    return sorted(range(len(bundle_nodes)),
                  key=lambda b: (bundle_nodes[b] != driver_node, first[bundle_nodes[b]], b))


def local_layout(places: list[dict[str, Any]],
                 on_cuda: bool) -> list[tuple[int, int, str | None]]:
    """Per rank: (local rank, ranks on its node, CUDA_VISIBLE_DEVICES for it or None).

    On CUDA a rank's local rank is its GPU's index among the GPUs of its node's ranks, which all
    of them see; on the CPU it is its index among its node's ranks.
    """
    by_node: dict[str, list[int]] = {}
    for rank, p in enumerate(places):
        by_node.setdefault(p["node_id"], []).append(rank)
    out: list[tuple[int, int, str | None]] = []
    for rank, p in enumerate(places):
        peers = by_node[p["node_id"]]
        if not on_cuda:
            out.append((peers.index(rank), len(peers), None))
            continue
        if len(p["gpu_ids"]) != 1:
            raise RuntimeError(f"rank {rank}'s Ray actor holds GPUs {p['gpu_ids']}, expected one")
        gpus = sorted({g for r in peers for g in places[r]["gpu_ids"]},
                      key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else 0, g))
        out.append((gpus.index(p["gpu_ids"][0]), len(peers), ",".join(gpus)))
    return out
