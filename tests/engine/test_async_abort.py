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
