"""benchmarks/ngram_sweep.py: replaying recorded greedy outputs through the scheduler and the
n-gram proposer counts what the engine does with the model."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from peregrine.engine import spec_scheduling as scheduler
from peregrine.testing.checkpoints import tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ngram_sweep  # noqa: E402


def _ids(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 500 + 5 for i in range(n)]


# Prompts that repeat themselves (matches at once) and one that does not (empty proposals).
PROMPTS = [_ids(6, 10) * 3, _ids(9, 99), _ids(4, 7) * 5]
OUTPUT_LEN = 40


def _engine_counts(spec: dict) -> tuple[int, int, int, int]:
    """The engine's (steps, verify steps, drafted, accepted) over PROMPTS, one at a time."""
    from peregrine import LLM, SamplingParams
    llm = LLM(tiny_checkpoint("llama"), speculative_config=spec, dtype="float32", device="cpu",
              max_model_len=128, seed=0)
    runner = llm.engine.core_client.core.executor.worker.model_runner
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    for p in PROMPTS:
        llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    st = llm.engine.get_stats()
    return (int(runner.timing["steps"]), int(runner.timing["verify_steps"]),
            st.spec_num_draft_tokens, st.spec_num_accepted_tokens)


@pytest.fixture(scope="module")
def recorded() -> list[dict[str, list[int]]]:
    return ngram_sweep.greedy_outputs(tiny_checkpoint("llama"),
                                      [{"prompt_token_ids": p} for p in PROMPTS], OUTPUT_LEN,
                                      dtype="float32", device="cpu", max_model_len=128)


@pytest.mark.slow
@pytest.mark.parametrize("k,lo,hi", [(4, 1, 3), (6, 2, 4)])
def test_replay_counts_what_the_engine_does(recorded, k, lo, hi) -> None:
    row = ngram_sweep.replay(recorded, k, lo, hi, max_model_len=128)
    steps, verify, drafted, accepted = _engine_counts(
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
         "prompt_lookup_max": hi, "disable_by_batch_size": None})
    assert row["verify_steps"] > 0 and row["empty_proposals"] > 0
    assert (row["steps"], row["verify_steps"]) == (steps, verify)
    assert row["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert row["tokens_per_step"] == pytest.approx(len(PROMPTS) * OUTPUT_LEN / steps)
    assert sum(row["accepted_lengths"].values()) == verify


def test_backoff_constants_are_restored_and_zero_turns_a_backoff_off() -> None:
    requests = [{"prompt": _ids(9, 99), "output": _ids(30, 300)}]  # nothing ever matches
    before = tuple(getattr(scheduler, n) for n in ngram_sweep.BACKOFF_NAMES)
    row = ngram_sweep.replay(requests, 4, 1, 2)
    with ngram_sweep.backoff_constants((0, 32, 0, 16)):
        off = ngram_sweep.replay(requests, 4, 1, 2)
    assert tuple(getattr(scheduler, n) for n in ngram_sweep.BACKOFF_NAMES) == before
    assert row["backing_off_steps"] > 0 and off["backing_off_steps"] == 0
    assert off["empty_proposals"] > row["empty_proposals"]
    assert row["steps"] == off["steps"] == 30  # nothing accepted: one token a step
