"""AsyncEngine over the real engine: an abort from the server side ends the request's stream."""
from __future__ import annotations

import asyncio

import pytest

from peregrine import SamplingParams
from peregrine.config import EngineArgs
from peregrine.engine.async_engine import AsyncEngine
from peregrine.engine.llm_engine import LLMEngine, QueueFullError
from peregrine.testing.checkpoints import tiny_checkpoint


def _engine(**kw) -> AsyncEngine:
    args = EngineArgs(model=tiny_checkpoint("llama"), dtype="float32", device="cpu",
                      max_model_len=128, **kw)
    return AsyncEngine(LLMEngine.from_engine_args(args))


def test_abort_by_id_ends_the_stream_with_an_abort_output() -> None:
    async def main():
        ae = _engine()
        ae.start()
        try:
            params = SamplingParams(max_tokens=100, ignore_eos=True)
            stream = await ae.add_request("req-1", [5, 6, 7], params)
            ae.abort("req-1")
            outs = [o async for o in stream]  # must end, not hang
            return outs
        finally:
            await ae.shutdown()
    outs = asyncio.run(asyncio.wait_for(main(), 60))
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 100


def test_n_above_the_queue_limit_is_a_plain_error_not_queue_full() -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=128,
        max_queue_len=2))
    with pytest.raises(ValueError, match="never") as info:
        engine.add_request("n", [5, 6], SamplingParams(n=3, max_tokens=2))
    assert not isinstance(info.value, QueueFullError)


@pytest.mark.parametrize("core_process", (False, True))
def test_after_an_abort_leaves_nothing_the_gauges_read_zero(core_process: bool) -> None:
    # the running and waiting counts come from the last step's snapshot: a request aborted
    # between steps, with nothing else in flight, must not stay counted while the engine idles
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=128,
        engine_core_process=core_process))
    try:
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.add_request("b", [5, 6, 8], SamplingParams(max_tokens=50, ignore_eos=True))
        for _ in range(20):
            engine.step()
            if engine.get_stats().num_running == 2:
                break
        assert engine.get_stats().num_running == 2
        engine.abort_request(["a", "b"])
        assert not engine.has_unfinished_requests()
        stats = engine.get_stats()
        assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
    finally:
        engine.shutdown()
