"""Pipeline parallelism through the engine: two (and two x two) worker processes (gloo,
float32) give exactly the single-process greedy and seeded tokens, with prefix caching, chunked
prefill, preemption and two steps in flight; a killed stage worker fails the engine by name."""
from __future__ import annotations

import os
import signal
import time

import pytest

from peregrine import LLM, SamplingParams
from peregrine.executor.multiproc import WorkerFailedError
from peregrine.testing.checkpoints import tiny_checkpoint

SHARED = [(13 * i + 7) % 450 + 20 for i in range(24)]  # a 24-token prefix: 6 blocks of 4
PROMPTS = [SHARED + [(5 * i + j) % 400 + 30 for i in range(n)]
           for j, n in enumerate((3, 17, 9, 21, 1))] + [[11, 12, 13]]
# NOTE: 4-token blocks, a 16-token step budget and 24 blocks for six sequences of up to 61
# tokens: prompts are chunked, share the prefix's blocks, and running sequences are preempted.
ENGINE = dict(dtype="float32", device="cpu", max_model_len=96, block_size=4,
              num_gpu_blocks_override=24, max_num_batched_tokens=16, max_num_seqs=4,
              enable_prefix_caching=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
PARAMS = [GREEDY] * (len(PROMPTS) - 2) + [SEEDED, SEEDED]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _want(path) -> list[list[int]]:
    llm = LLM(path, **ENGINE)
    try:
        return _tokens(llm)
    finally:
        llm.engine.shutdown()


def _segments() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _check_run(llm: LLM, want: list[list[int]]) -> None:
    core = llm.engine.core_client.core
    core.executor.stage_stats(reset=True)
    assert _tokens(llm) == want
    assert core.scheduler.num_preemptions > 0  # the pool forced recomputes
    assert core.pipeline.max_in_flight == 2  # two micro-batches were in the pipeline at once
    stats = core.executor.stage_stats()
    assert len(stats) == core.executor.world_size
    assert all(s["steps"] > 0 and 0.0 <= s["idle_fraction"] < 1.0 for s in stats)


@pytest.mark.slow
@pytest.mark.parametrize("arch,layers,partition", [("llama", 3, "1,2"), ("qwen3", 2, None)])
def test_two_stages_give_the_single_process_tokens(monkeypatch, arch: str, layers: int,
                                                   partition: str | None) -> None:
    path = tiny_checkpoint(arch, num_hidden_layers=layers)
    want = _want(path)
    if partition is not None:
        monkeypatch.setenv("PEREGRINE_PP_LAYER_PARTITION", partition)
    before = _segments()
    llm = LLM(path, pipeline_parallel_size=2, **ENGINE)
    executor = llm.engine.core_client.core.executor
    pids = executor.worker_pids
    _check_run(llm, want)
    llm.engine.check_health()
    llm.engine.shutdown()
    assert not any(map(_alive, pids))
    assert _segments() <= before


@pytest.mark.slow
def test_two_stages_of_two_ranks_give_the_single_process_tokens_and_fail_by_name() -> None:
    # qwen3 ties the LM head to the embedding: the last stage reads the embedding's tensor;
    # 3 layers: the even split is 2 + 1
    path = tiny_checkpoint("qwen3", num_hidden_layers=3)
    want = _want(path)
    before = _segments()
    llm = LLM(path, pipeline_parallel_size=2, tensor_parallel_size=2, async_scheduling=True,
              **ENGINE)
    executor = llm.engine.core_client.core.executor
    pids, ring = executor.worker_pids, executor.ring_name
    assert len(pids) == 4 and ring in _segments()
    assert llm.engine.config.pp_layer_partition == (2, 1)
    _check_run(llm, want)
    os.kill(pids[3], signal.SIGKILL)  # the last stage's second tensor-parallel rank
    t0 = time.monotonic()
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 10.0
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    with pytest.raises(WorkerFailedError, match=r"worker rank 3 \(pipeline stage 1, "
                                                r"tensor-parallel rank 1\).*exited unexpectedly"):
        llm.engine.check_health()
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids))
    assert _segments() <= before
    llm.engine.shutdown()


@pytest.mark.slow
def test_two_stages_through_their_graph_runners_give_the_single_process_tokens(
        monkeypatch) -> None:
    # Each stage builds its decode and piecewise graph runners over its own layers (run eagerly
    # here: CUDA graphs need a GPU) and the padded steps pass through the stages' fixed buffers;
    # the single process runs its graph runners too (the same padding, the same kernels).
    monkeypatch.setenv("PEREGRINE_GRAPH_PATHS_ON_CPU", "1")
    path = tiny_checkpoint("llama", num_hidden_layers=3)
    engine = dict(ENGINE, attention_backend="triton")
    single = LLM(path, **engine)
    try:
        want = _tokens(single)
        runner = single.engine.core_client.core.executor.worker.model_runner
        assert runner.graphs is not None and runner.prefill_graphs is not None
    finally:
        single.engine.shutdown()
    llm = LLM(path, pipeline_parallel_size=2, **engine)
    try:
        _check_run(llm, want)
        stats = llm.engine.core_client.core.executor.stage_stats()
        # decode steps through the decode graphs' runner and chunks through the piecewise one
        assert all(0 < s["graph_steps"] <= s["steps"] for s in stats)
    finally:
        llm.engine.shutdown()
