"""UniprocExecutor: one in-process worker behind the Executor interface."""
from __future__ import annotations

import pytest

from peregrine import LLM, SamplingParams
from peregrine.config import EngineArgs
from peregrine.executor import UniprocExecutor, executor_class_for
from peregrine.messages import CachedRequestData, NewRequestData, SchedulerOutput
from peregrine.testing.checkpoints import tiny_checkpoint


def _config(**kw):
    args = dict(model=str(tiny_checkpoint("llama")), dtype="float32", device="cpu",
                max_model_len=64, num_gpu_blocks_override=12)
    return EngineArgs(**{**args, **kw}).create_engine_config()


def test_executor_sizes_the_cache_and_runs_a_step() -> None:
    ex = executor_class_for(_config())(_config())
    assert isinstance(ex, UniprocExecutor) and ex.num_blocks == 12
    new = NewRequestData("r", [5, 6, 7], SamplingParams(temperature=0.0), 0, (), [0], 0)
    future = ex.execute_model(SchedulerOutput([new], CachedRequestData(), {"r": 3}, 3, [], []))
    out = future.result()
    assert out.req_ids == ["r"] and len(out.sampled_token_ids[0]) == 1
    assert future.result() is out  # collected once
    ex.check_health()
    ex.shutdown()
    ex.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        ex.check_health()


def test_penalties_and_min_tokens_are_exact_with_async_scheduling() -> None:
    """No step is drained for penalties: the worker's device-side counts and its own step index
    make async scheduling sample exactly the sync tokens."""
    prompts = [[(11 * i + 3) % 500 + 5 for i in range(n)] for n in (7, 19, 4)]
    params = [SamplingParams(temperature=0.9, seed=3, max_tokens=12, presence_penalty=1.2,
                             frequency_penalty=0.6, min_tokens=8, ignore_eos=False),
              SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.7, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, max_tokens=12, top_k=20, ignore_eos=True,
                             logit_bias={7: 3.0})]
    outs = []
    for mode in (False, True):
        llm = LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=64,
                  async_scheduling=mode, max_num_batched_tokens=16)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]
    assert len(outs[0][0]) >= 8
