"""The engine core behind the front end: in this process or its own, the same tokens come out."""
from __future__ import annotations

import pytest

from peregrine import SamplingParams
from peregrine.config import EngineArgs
from peregrine.engine.core_client import EngineCoreDeadError, ProcessCoreClient
from peregrine.engine.llm_engine import LLMEngine, QueueFullError
from peregrine.testing.checkpoints import tiny_checkpoint


def _ids(n: int, start: int = 10) -> list[int]:
    return [(start + 7 * i) % 500 + 5 for i in range(n)]


def _engine(**kw) -> LLMEngine:
    args = EngineArgs(model=tiny_checkpoint("llama"), dtype="float32", device="cpu",
                      max_model_len=128, **kw)
    return LLMEngine.from_engine_args(args)


def _run(engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams) -> dict[str, tuple]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    done: dict[str, tuple] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                done[out.request_id] = (o.token_ids, o.text, o.finish_reason, o.stop_reason)
    return done


@pytest.mark.slow
def test_core_in_its_own_process_gives_the_same_outputs() -> None:
    prompts = [_ids(9), _ids(40, 3), _ids(5, 77)]
    sp = SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True, logprobs=2)
    local = _run(_engine(), prompts, sp)
    remote_engine = _engine(engine_core_process=True)
    try:
        assert isinstance(remote_engine.core_client, ProcessCoreClient)
        remote = _run(remote_engine, prompts, sp)
        assert remote == local
        # A stop string found by the front end aborts the sequence in the core.
        text = local["1"][1]
        stop = text[len(text) // 2:len(text) // 2 + 2]
        if stop:
            stopped = _run(remote_engine, [prompts[1]], SamplingParams(
                temperature=0.8, seed=11, max_tokens=10, ignore_eos=True, stop=[stop]))
            assert stopped["0"][2] == "stop" and stop not in stopped["0"][1]
        remote_engine.check_health()
    finally:
        remote_engine.shutdown()
    with pytest.raises(EngineCoreDeadError):
        remote_engine.core_client.check_health()


@pytest.mark.slow
def test_core_process_that_cannot_start_reports_why(tmp_path) -> None:
    import shutil
    from pathlib import Path
    for f in Path(tiny_checkpoint("llama")).iterdir():
        if f.suffix != ".safetensors":  # the front end starts, the core finds no weights
            shutil.copy(f, tmp_path / f.name)
    args = EngineArgs(model=str(tmp_path), dtype="float32", device="cpu", max_model_len=128,
                      engine_core_process=True)
    with pytest.raises(ValueError, match="failed to start.*safetensors"):
        LLMEngine.from_engine_args(args)


def test_queue_limit_counts_requests_not_yet_started() -> None:
    engine = _engine(max_queue_len=2)
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", _ids(4), sp)
    engine.add_request("b", _ids(4), sp)
    with pytest.raises(QueueFullError, match="max_queue_len=2"):
        engine.add_request("c", _ids(4), sp)
    with pytest.raises(QueueFullError):
        engine.add_request("n", _ids(4), SamplingParams(n=2, max_tokens=2))
    engine.step()  # both start
    engine.add_request("c", _ids(4), sp)
    assert engine.get_num_unfinished_requests() == 3


@pytest.mark.slow
def test_a_burst_of_requests_does_not_deadlock_the_two_pipes() -> None:
    import threading
    engine = _engine(engine_core_process=True, max_num_seqs=256)
    done: dict[str, int] = {}

    def burst() -> None:
        # NOTE: the adds fill the pipe to the core while its step outputs (with logprobs) fill the
        # pipe back: with blocking sends on both sides, each would wait for the other forever.
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
        for i in range(1500):
            engine.add_request(f"burst-request-{i:06d}", _ids(100, i), sp)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = len(out.outputs[0].token_ids)

    try:
        t = threading.Thread(target=burst, daemon=True)
        t.start()
        t.join(240)
        assert not t.is_alive(), "the front end and the core are stuck"
        assert len(done) == 1500 and set(done.values()) == {8}
    finally:
        engine.shutdown()


def test_a_failing_tokenizer_stops_the_core_process_spawned_before_it(monkeypatch) -> None:
    """The core process starts before the tokenizer loads (so the two overlap); when the
    tokenizer fails, the error propagates and no core process is left behind."""
    import multiprocessing

    import peregrine.engine.llm_engine as llm_engine
    before = {p.pid for p in multiprocessing.active_children()}
    seen: list[set[int]] = []

    def failing_load(path: str):
        seen.append({p.pid for p in multiprocessing.active_children()} - before)
        raise ValueError("could not load a tokenizer (broken on purpose)")

    monkeypatch.setattr(llm_engine, "load_tokenizer", failing_load)
    with pytest.raises(ValueError, match="broken on purpose"):
        _engine(engine_core_process=True)
    assert len(seen) == 1 and len(seen[0]) == 1  # the core was already starting
    assert {p.pid for p in multiprocessing.active_children()} <= before


def test_an_in_process_core_freezes_its_startup_heap_until_the_engine_is_dropped(
        monkeypatch) -> None:
    """Full garbage collections skip what start-up built while the engine lives; once it is
    dropped (or shut down) the heap is unfrozen, so the engine's own cycles can be collected.
    (On CUDA; a CPU engine does it when asked, as here.)"""
    import gc
    import weakref

    from peregrine.engine import core_client
    gc.unfreeze()
    _engine()
    assert gc.get_freeze_count() == 0  # CPU engines leave the heap alone
    monkeypatch.setattr(core_client, "freezes_heap", lambda config: True)
    engine = _engine()
    assert gc.get_freeze_count() > 0
    assert _run(engine, [_ids(6)], SamplingParams(max_tokens=3, ignore_eos=True))["0"][0]
    model = weakref.ref(engine.core_client.core.executor.worker.model)
    del engine
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert model() is None
    engine = _engine()
    assert gc.get_freeze_count() > 0
    engine.shutdown()
    assert gc.get_freeze_count() == 0
