"""RayExecutor: Ray actors behind the Executor interface give the single-process tokens; a failed
or dead actor fails the engine with the rank named; nothing is left behind."""
from __future__ import annotations

import time

import pytest

from peregrine import LLM, SamplingParams
from peregrine.config import EngineArgs
from peregrine.executor import WorkerFailedError, executor_class_for
from peregrine.executor.ray_executor import RayExecutor
from peregrine.messages import CachedRequestData, NewRequestData, SchedulerOutput
from peregrine.testing.checkpoints import tiny_checkpoint

# NOTE: the ray tier (`pytest -m ray`, with the ray extra installed): each test starts Ray actors,
# seconds each on two cores.
pytestmark = [pytest.mark.ray, pytest.mark.slow]

SHARED = [(13 * i + 7) % 450 + 20 for i in range(24)]  # a 24-token prefix: 6 blocks of 4
PROMPTS = [SHARED + [(5 * i + j) % 400 + 30 for i in range(n)]
           for j, n in enumerate((3, 17, 9, 21))] + [[11, 12, 13]]
# NOTE: 4-token blocks, a 16-token step budget and 24 blocks for five sequences of up to 61
# tokens: prompts are chunked, share the prefix's blocks, and running sequences are preempted.
ENGINE = dict(dtype="float32", device="cpu", max_model_len=96, block_size=4,
              num_gpu_blocks_override=24, max_num_batched_tokens=16, max_num_seqs=4,
              enable_prefix_caching=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
RAY = dict(tensor_parallel_size=2, distributed_executor_backend="ray")


@pytest.fixture(scope="module")
def ray():
    """The ray module, with one local Ray instance for the module (each test's engine joins it)."""
    import ray
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    """The single-process greedy tokens."""
    llm = LLM(tiny_checkpoint("llama"), **ENGINE)
    try:
        return _tokens(llm)
    finally:
        llm.engine.shutdown()


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _executor(llm: LLM) -> RayExecutor:
    ex = llm.engine.core_client.core.executor
    assert isinstance(ex, RayExecutor)
    return ex


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _assert_released(ray, pids: list[int], pg) -> None:
    """The actors' processes have exited, the placement group is removed, its CPUs are free."""
    assert _wait_until(lambda: all(map(_gone, pids))), "an actor outlived the executor"
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    total = ray.cluster_resources()["CPU"]
    assert _wait_until(lambda: ray.available_resources().get("CPU") == total), \
        "the placement group's CPUs were not given back"


def _config(**kw):
    args = dict(model=str(tiny_checkpoint("llama")), dtype="float32", device="cpu",
                max_model_len=64, num_gpu_blocks_override=12, **RAY)
    return EngineArgs(**{**args, **kw}).create_engine_config()


def _step(req_id: str, prompt: list[int]) -> SchedulerOutput:
    new = NewRequestData(req_id, prompt, SamplingParams(temperature=0.0), 0, (), [0], 0)
    return SchedulerOutput([new], CachedRequestData(), {req_id: len(prompt)}, len(prompt), [], [])


def test_two_ranks_give_the_single_process_tokens_and_a_second_engine_works(ray, want):
    for async_scheduling in (False, True):  # the second engine after the first's shutdown
        llm = LLM(tiny_checkpoint("llama"), async_scheduling=async_scheduling, **RAY, **ENGINE)
        ex = _executor(llm)
        pids, pg = ex.worker_pids, ex.placement_group
        assert len(set(pids)) == 2 and not any(map(_gone, pids))
        assert _tokens(llm) == want
        sched = llm.engine.core_client.core.scheduler
        assert sched.num_preemptions > 0  # the pool forced recomputes
        assert sched.kv.prefix_cache_hits > 0  # the shared prefix was found in the cache
        assert sched.kv.num_blocks == 24
        llm.engine.check_health()
        llm.engine.shutdown()
        _assert_released(ray, pids, pg)
        assert ray.is_initialized()  # the module's Ray instance is not the engine's to stop


def test_two_pipeline_stages_give_the_single_process_tokens_and_fail_by_stage(ray, want):
    llm = LLM(tiny_checkpoint("llama"), pipeline_parallel_size=2,
              distributed_executor_backend="ray", **ENGINE)
    ex = _executor(llm)
    core = llm.engine.core_client.core
    pids, pg = ex.worker_pids, ex.placement_group
    try:
        assert ex.world_size == 2 and llm.engine.config.pp_layer_partition == (1, 1)
        ex.stage_stats(reset=True)
        assert _tokens(llm) == want  # rank 1, the last stage, returned them
        assert core.scheduler.num_preemptions > 0
        assert core.pipeline.max_in_flight == 2  # both stages had a step at once
        stats = ex.stage_stats()
        assert len(stats) == 2 and all(s["steps"] > 0 for s in stats)
        # NOTE: the first stage dies; the last one waits in its receive until it is released.
        ray.kill(ex.worker_actors[0])
        outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
        with pytest.raises(WorkerFailedError, match=r"worker rank 0 \(pipeline stage 0, "
                                                    r"tensor-parallel rank 0\) \(Ray actor on "
                                                    r".*\) died"):
            llm.engine.check_health()
        _assert_released(ray, pids, pg)
    finally:
        llm.engine.shutdown()


def test_a_killed_actor_fails_the_requests_and_the_health_check_naming_its_rank(ray):
    llm = LLM(tiny_checkpoint("llama"), **RAY, **ENGINE)
    ex = _executor(llm)
    pids, pg = ex.worker_pids, ex.placement_group
    try:
        assert len(_tokens(llm)) == len(PROMPTS)
        ray.kill(ex.worker_actors[1])
        t0 = time.monotonic()
        outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 10.0
        assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
        with pytest.raises(WorkerFailedError, match=r"rank 1 \(Ray actor on .*\) died"):
            llm.engine.check_health()
        _assert_released(ray, pids, pg)
    finally:
        llm.engine.shutdown()


def test_an_idle_dead_actor_fails_the_health_check_within_seconds(ray):
    config = _config()
    ex = executor_class_for(config)(config)
    assert isinstance(ex, RayExecutor) and ex.num_blocks == 12
    pids, pg = ex.worker_pids, ex.placement_group
    try:
        out = ex.execute_model(_step("a", [5, 6, 7])).result()
        assert out.req_ids == ["a"] and len(out.sampled_token_ids[0]) == 1
        ex.check_health()
        ray.kill(ex.worker_actors[0])
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match="rank 0"):
            while time.monotonic() - t0 < 10.0:  # /health's probes: each check is cheap
                ex.check_health()
                time.sleep(0.1)
        with pytest.raises(WorkerFailedError, match="rank 0"):
            ex.execute_model(_step("b", [8, 9]))
        _assert_released(ray, pids, pg)
    finally:
        ex.shutdown()
    ex.shutdown()


def test_an_exception_in_a_step_fails_it_with_the_workers_message(ray):
    config = _config()
    ex = executor_class_for(config)(config)
    pids, pg = ex.worker_pids, ex.placement_group
    try:
        bad = SchedulerOutput([], CachedRequestData(["nobody"], [[]], [0]), {"nobody": 1}, 1, [],
                              [])
        future = ex.execute_model(bad)  # asynchronous: the error comes with the result
        with pytest.raises(WorkerFailedError,
                           match=r"rank [01] failed: ValueError: cached request "
                                  r"'nobody' is unknown to the worker"):
            future.result()
        with pytest.raises(WorkerFailedError):
            ex.execute_model(_step("a", [5, 6]))
        _assert_released(ray, pids, pg)
    finally:
        ex.shutdown()


def test_an_engine_core_process_joins_the_running_cluster(ray, want, monkeypatch):
    # the core's own process connects to it
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    before = ray.util.placement_group_table()
    llm = LLM(tiny_checkpoint("llama"), engine_core_process=True, **RAY, **ENGINE)
    try:
        assert _tokens(llm) == want
        ours = [pg for pid, pg in ray.util.placement_group_table().items() if pid not in before]
        assert [pg["state"] for pg in ours] == ["CREATED"]  # the core's actors live in this cluster
    finally:
        llm.engine.shutdown()
    assert _wait_until(lambda: ray.util.placement_group_table()[ours[0]["placement_group_id"]]
                       ["state"] == "REMOVED")
    assert ray.is_initialized()


def test_a_cluster_without_room_for_the_ranks_fails_the_start_clearly(ray, monkeypatch):
    from ray.util.placement_group import placement_group, remove_placement_group

    import peregrine.executor.ray_executor as ray_executor
    monkeypatch.setattr(ray_executor, "_PLACEMENT_TIMEOUT_S", 2.0)
    config = _config()
    total = int(ray.cluster_resources()["CPU"])
    with pytest.raises(RuntimeError, match=f"{total + 1} ranks need {total + 1} CPUs, but the "
                                           f"Ray cluster has {total}"):
        ray_executor._reserve(ray, total + 1, on_cuda=False)
    hog = placement_group([{"CPU": total}])  # another job holds every CPU
    ray.get(hog.ready())
    before = set(ray.util.placement_group_table())
    try:
        with pytest.raises(RuntimeError, match="did not free 2 CPUs for the workers within 2 s"):
            RayExecutor(config)
        left = {pid: pg["state"] for pid, pg in ray.util.placement_group_table().items()
                if pid not in before}
        assert set(left.values()) <= {"REMOVED"}, left  # its own placement group is given up
    finally:
        remove_placement_group(hog)
    assert ray.is_initialized()
