"""Async scheduling offline keeps one step in flight: every step is launched before the previous
one is collected, none is drained early, and the tokens equal synchronous scheduling's."""
from __future__ import annotations

from collections import Counter

from peregrine import SamplingParams
from peregrine.config import EngineArgs
from peregrine.engine.core_client import InprocCoreClient
from peregrine.engine.llm_engine import LLMEngine
from peregrine.testing.checkpoints import tiny_checkpoint

_PROMPTS = {str(i): [(5 + 13 * i + 3 * j) % 400 + 7 for j in range(4 + 3 * i)] for i in range(6)}
_MAX_TOKENS = 10


def _run(async_scheduling: bool) -> tuple[dict[str, list[int]], Counter, int]:
    """(tokens per request, completes by (in flight, had tokens), engine steps)."""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=64,
        async_scheduling=async_scheduling))
    assert isinstance(engine.core_client, InprocCoreClient)  # offline: no core process, no pacer
    core = engine.core_client.core
    completes: Counter = Counter()
    complete = core.complete

    def counted(sched, future, out, in_flight):
        completes[(in_flight, sched.total_num_scheduled_tokens > 0)] += 1
        return complete(sched, future, out, in_flight)

    core.complete = counted
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=_MAX_TOKENS, ignore_eos=True)
    for rid, ids in _PROMPTS.items():
        engine.add_request(rid, ids, sp)
    done: dict[str, list[int]] = {}
    steps = 0
    try:
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    finally:
        engine.shutdown()
    return done, completes, steps


def test_offline_async_batch_pipelines_every_step():
    tokens, completes, steps = _run(async_scheduling=True)
    # One prefill step and MAX_TOKENS - 1 decode steps, each collected one engine step later
    # (in flight), then one step with nothing to launch that collects the last of them.
    assert completes == {(True, True): _MAX_TOKENS, (False, False): 1}, completes
    assert steps == _MAX_TOKENS + 1
    sync_tokens, sync_completes, sync_steps = _run(async_scheduling=False)
    assert sync_completes == {(False, True): _MAX_TOKENS} and sync_steps == _MAX_TOKENS
    assert tokens == sync_tokens and all(len(t) == _MAX_TOKENS for t in tokens.values())
