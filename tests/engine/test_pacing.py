"""The core process's launch pacer: listen for requests only while the device has work queued."""
from __future__ import annotations

import pytest

from peregrine import SamplingParams
from peregrine.config import EngineArgs
from peregrine.engine.llm_engine import LLMEngine
from peregrine.engine.pacing import LaunchPacer
from peregrine.testing.checkpoints import tiny_checkpoint


def _fill(pacer: LaunchPacer, idle: list[float]) -> None:
    for w in idle:
        pacer.observe(w)


def test_no_budget_until_the_window_is_full() -> None:
    pacer = LaunchPacer(window=4, min_margin_s=0.001, margin_fraction=0.25)
    _fill(pacer, [0.010] * 3)
    assert pacer.budget() == 0.0
    pacer.observe(0.010)
    assert pacer.budget() == pytest.approx(0.010 - 0.25 * 0.010)


def test_budget_is_the_lowest_idle_time_less_a_margin() -> None:
    pacer = LaunchPacer(window=4, min_margin_s=0.001, margin_fraction=0.25)
    _fill(pacer, [0.020, 0.004, 0.030, 0.025])
    assert pacer.budget() == pytest.approx(0.004 - 0.001)  # the margin's floor wins at 4 ms
    _fill(pacer, [0.020] * 4)
    assert pacer.budget() == pytest.approx(0.015)
    _fill(pacer, [0.0012] * 4)  # too little slack to be worth listening
    assert pacer.budget() == 0.0


def test_time_listened_counts_as_idle_time() -> None:
    pacer = LaunchPacer(window=2, min_margin_s=0.001, margin_fraction=0.25)
    _fill(pacer, [0.020, 0.020])
    for _ in range(10):  # listening the whole budget leaves the device wait short
        budget = pacer.budget()
        pacer.listened(budget)
        pacer.observe(0.020 - budget)
    assert pacer.budget() == pytest.approx(0.015)


def test_an_overshooting_budget_shrinks_until_the_device_never_waits() -> None:
    # The device's step leaves the host 10 ms idle; pretend the history said 40 ms.
    true_idle, pacer = 0.010, LaunchPacer(window=2, min_margin_s=0.001)
    _fill(pacer, [0.040, 0.040])
    budgets = []
    for _ in range(20):
        budget = pacer.budget()
        budgets.append(budget)
        pacer.listened(budget)
        # Listening past the device's idle time means the host no longer waits for it.
        pacer.observe(max(0.0, true_idle - budget))
    assert all(b2 <= b1 for b1, b2 in zip(budgets, budgets[1:]))
    assert budgets[-1] < true_idle


def test_default_margin_leaves_a_fixed_slice_of_a_short_step_unspent() -> None:
    pacer = LaunchPacer(window=2)
    _fill(pacer, [0.0036, 0.0036])  # a ~5 ms decode step leaving the host 3.6 ms
    assert pacer.budget() == pytest.approx(0.0036 - 0.0004)
    _fill(pacer, [0.020, 0.020])  # long steps keep a tenth in reserve
    assert pacer.budget() == pytest.approx(0.018)


def test_a_restarted_pipeline_forgets_the_history() -> None:
    pacer = LaunchPacer(window=2)
    _fill(pacer, [0.020, 0.020])
    pacer.observe(None)
    assert pacer.budget() == 0.0
    with pytest.raises(ValueError):
        LaunchPacer(window=0)


@pytest.mark.slow
def test_paced_core_process_gives_the_same_tokens_with_requests_arriving_mid_run() -> None:
    """Async scheduling in the core process (where the pacer runs), requests added while others
    decode: every request's tokens equal the in-process synchronous engine's."""
    prompts = {str(i): [(3 + 11 * i + 7 * j) % 500 + 5 for j in range(6 + 5 * i)]
               for i in range(5)}
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)

    def run(**kw) -> dict[str, list[int]]:
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=128,
            **kw))
        done: dict[str, list[int]] = {}
        try:
            pending = list(prompts.items())
            rid, ids = pending.pop(0)
            engine.add_request(rid, ids, sp)
            steps = 0
            while engine.has_unfinished_requests() or pending:
                steps += 1
                if pending and steps % 3 == 0:
                    rid, ids = pending.pop(0)
                    engine.add_request(rid, ids, sp)
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
        finally:
            engine.shutdown()
        return done

    local = run(async_scheduling=False)
    remote = run(async_scheduling=True, engine_core_process=True)
    assert set(local) == set(prompts) and remote == local
