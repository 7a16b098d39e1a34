"""Tensor parallelism through the engine: two worker processes (gloo, float32) give exactly the
single-process greedy (and seeded) tokens, with prefix caching, chunked prefill and preemption."""
from __future__ import annotations

import os

import pytest

from peregrine import LLM, SamplingParams
from peregrine.config import EngineArgs
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
# NOTE: every rank samples (the same tokens: the same gathered logits, noise keyed on seed and
# position); a rank that drew another token would feed the others a different KV cache.
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
PARAMS = [GREEDY] * (len(PROMPTS) - 2) + [SEEDED, SEEDED]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _scheduler(llm: LLM):
    return llm.engine.core_client.core.scheduler


def _segments() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_give_the_single_process_greedy_tokens(arch: str) -> None:
    path = tiny_checkpoint(arch)
    want_llm = LLM(path, **ENGINE)
    want = _tokens(want_llm)
    want_llm.engine.shutdown()
    before = _segments()
    llm = LLM(path, tensor_parallel_size=2, async_scheduling=(arch == "llama"), **ENGINE)
    executor = llm.engine.core_client.core.executor
    pids, ring = executor.worker_pids, executor.ring_name
    assert len(pids) == 2 and all(map(_alive, pids)) and ring in _segments()
    assert _tokens(llm) == want
    sched = _scheduler(llm)
    assert sched.num_preemptions > 0  # the pool forced recomputes
    assert sched.kv.num_blocks == 24
    llm.engine.check_health()
    llm.engine.shutdown()
    assert not any(map(_alive, pids))
    assert _segments() <= before


@pytest.mark.slow
def test_two_ranks_under_an_engine_core_process_and_a_second_engine_after_the_first() -> None:
    path = tiny_checkpoint("llama")
    want_llm = LLM(path, **ENGINE)
    want = _tokens(want_llm)
    want_llm.engine.shutdown()
    llm = LLM(path, tensor_parallel_size=2, engine_core_process=True, **ENGINE)
    assert _tokens(llm) == want
    llm.engine.shutdown()
    again = LLM(path, tensor_parallel_size=2, **ENGINE)
    assert _tokens(again) == want
    again.engine.shutdown()


def test_heads_that_do_not_divide_are_refused_with_the_flag_named() -> None:
    # tiny checkpoints have 4 query heads and 2 KV heads
    path = str(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide .*num_attention_"
                                         "heads"):
        EngineArgs(model=path, device="cpu", tensor_parallel_size=3).create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 does not divide .*num_key_value"):
        EngineArgs(model=path, device="cpu", tensor_parallel_size=4).create_engine_config()
    with pytest.raises(ValueError, match="distributed_executor_backend: uni runs one worker"):
        EngineArgs(model=path, device="cpu", tensor_parallel_size=2,
                   distributed_executor_backend="uni").create_engine_config()
    cfg = EngineArgs(model=path, device="cpu", tensor_parallel_size=2).create_engine_config()
    assert cfg.distributed_executor_backend == "mp" and cfg.world_size == 2
    assert EngineArgs(model=path, device="cpu").create_engine_config() \
        .distributed_executor_backend == "uni"
