"""The Worker driven by hand-built SchedulerOutputs: chunked prefill, decodes, preemption and resume,
finish, sync and async; greedy tokens and logprobs equal transformers'."""
from __future__ import annotations

import math

import pytest
import torch
from worker_helpers import Step, hf_greedy, make_worker, new_req, run_steps

from peregrine.messages import SchedulerOutput
from peregrine.worker import model_runner

ARCH = "qwen3"
PROMPT_A = [17, 301, 45, 99, 230, 8, 77, 150, 9, 64, 12]  # 11 tokens: a chunk of 8, then 3
PROMPT_B = [5, 41, 300, 7, 222, 18]


def _steps() -> list[Step]:
    """A's prompt is chunked; B is preempted while its third token is in flight (async) and
    resumes with the two tokens the scheduler kept; A finishes while B goes on."""
    a_tok, _, _ = hf_greedy(ARCH, tuple(PROMPT_A), 4)
    b_tok, _, _ = hf_greedy(ARCH, tuple(PROMPT_B), 5)
    a = new_req("a", PROMPT_A, [0, 1], logprobs=2, prompt_logprobs=1)
    b = new_req("b", PROMPT_B, [5, 6, 7], logprobs=0)
    b_resumed = new_req("b", PROMPT_B, [9, 10, 11], output=b_tok[:2], logprobs=0)
    return [
        Step({"a": 8, "b": 6}, new=[a, b]),
        Step({"a": 3, "b": 1}, computed={"a": 8, "b": 6}, new_blocks={"a": [2, 3, 4]}),
        Step({"a": 1, "b": 1}, computed={"a": 11, "b": 7}),
        Step({"a": 1}, computed={"a": 12}, preempted=["b"]),
        Step({"a": 1, "b": 8}, computed={"a": 13}, new=[b_resumed]),
        Step({"b": 1}, computed={"b": 8}, finished=["a"]),
        Step({"b": 1}, computed={"b": 9}),
    ]


def _check_logprobs(entry, want_row: torch.Tensor, want_token: int) -> None:
    assert entry.token_ids[0][0] == want_token
    for tok, lp in zip(entry.token_ids[0], entry.logprobs[0]):
        assert math.isclose(lp, want_row[tok].item(), abs_tol=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_hand_built_steps_give_transformers_greedy_tokens_and_logprobs(
        async_scheduling: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    a_tok, a_rows, a_prompt = hf_greedy(ARCH, tuple(PROMPT_A), 4)
    b_tok, b_rows, _ = hf_greedy(ARCH, tuple(PROMPT_B), 5)
    steps = _steps()
    in_flight_inputs: list[int] = []
    plan = model_runner.plan_step
    monkeypatch.setattr(model_runner, "plan_step", lambda *a: (
        p := plan(*a), in_flight_inputs.append(p.pending_dst.size))[0])
    outs = run_steps(make_worker(ARCH), steps, async_scheduling)
    # Async: each decode's input is still in flight (the resumed B recomputes known tokens).
    assert in_flight_inputs == ([0, 1, 2, 1, 1, 1, 1] if async_scheduling else [0] * 7)
    # Per step: (request, output index) of each sampled token; [] = a chunk that samples nothing.
    want = [{"a": None, "b": 0}, {"a": 0, "b": 1}, {"a": 1, "b": 2}, {"a": 2},
            {"a": 3, "b": 2}, {"b": 3}, {"b": 4}]
    for step, out, exp in zip(steps, outs, want):
        assert out.req_ids == list(step.scheduled)  # the scheduler's order, decodes or not
        for rid, got in zip(out.req_ids, out.sampled_token_ids):
            tokens, rows = (a_tok, a_rows) if rid == "a" else (b_tok, b_rows)
            if exp[rid] is None:
                assert got == [] and rid not in out.logprobs
                continue
            assert got == [tokens[exp[rid]]], (rid, exp[rid])
            _check_logprobs(out.logprobs[rid], rows[exp[rid]], got[0])
            assert len(out.logprobs[rid].token_ids[0]) == (3 if rid == "a" else 1)
    # A's prompt logprobs: positions 0..7 in the first chunk, 8..9 in the second.
    first, second = outs[0].prompt_logprobs["a"], outs[1].prompt_logprobs["a"]
    assert len(first.token_ids) == 8 and len(second.token_ids) == 2
    for pos, (ids, lps) in enumerate(zip(first.token_ids + second.token_ids,
                                         first.logprobs + second.logprobs)):
        assert ids[0] == PROMPT_A[pos + 1] and len(ids) == 2
        for tok, lp in zip(ids, lps):
            assert math.isclose(lp, a_prompt[pos, tok].item(), abs_tol=1e-4)
    assert "b" not in outs[0].prompt_logprobs


def test_worker_keeps_its_own_tokens_and_frees_finished_rows() -> None:
    worker = make_worker(ARCH)
    run_steps(worker, _steps()[:6], async_scheduling=True)
    batch = worker.model_runner.batch
    b_tok, _, _ = hf_greedy(ARCH, tuple(PROMPT_B), 5)
    assert list(batch.row_of) == ["b"] and batch.row_of["b"] == 0  # condensed into row 0
    assert batch.output_token_ids("b") == b_tok[:4]
    assert batch.block_ids("b") == [9, 10, 11]


def test_an_empty_step_still_drops_finished_requests() -> None:
    worker = make_worker(ARCH)
    run_steps(worker, _steps()[:1], async_scheduling=False)
    out = worker.collect(worker.execute_model(SchedulerOutput([], Step({}).output().scheduled_cached_reqs,
                                                              {}, 0, [], ["a", "b"])))
    assert out.req_ids == [] and out.sampled_token_ids == []
    assert worker.model_runner.batch.num_reqs == 0


def test_unknown_cached_request_is_rejected() -> None:
    worker = make_worker(ARCH)
    with pytest.raises(ValueError, match="unknown"):
        worker.execute_model(Step({"x": 1}, computed={"x": 3}).output())


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.8),
                                       dict(presence_penalty=1.5, frequency_penalty=0.5)])
def test_penalties_are_exact_with_a_step_in_flight(penalties: dict) -> None:
    """Penalty counts are updated on the device after each sampling, so async steps see the
    in-flight token; greedy with penalties equals transformers' generate."""
    want, _, _ = hf_greedy(ARCH, tuple(PROMPT_B), 6, **penalties)
    plain, _, _ = hf_greedy(ARCH, tuple(PROMPT_B), 6)
    assert want != plain, "the penalty does not change the greedy tokens: a weak test"
    for mode in (False, True):
        r = new_req("p", PROMPT_B, [0, 1, 2, 3], **penalties)
        steps = [Step({"p": 6}, new=[r])] + [Step({"p": 1}, computed={"p": 6 + i}) for i in range(5)]
        outs = run_steps(make_worker(ARCH), steps, mode)
        assert [t for o in outs for t in o.sampled_token_ids[0]] == want, mode


def test_seeded_sampling_is_the_same_sync_and_async_with_penalties_and_min_tokens() -> None:
    def tokens(mode: bool) -> list[int]:
        r = new_req("s", PROMPT_A, [0, 1, 2, 3, 4], seed=123, temperature=1.0,
                    presence_penalty=1.5, frequency_penalty=0.7, min_tokens=3, eos=(3, 4))
        q = new_req("t", PROMPT_B, [8, 9, 10], seed=7, temperature=0.7, top_p=0.9)
        steps = [Step({"s": 11, "t": 6}, new=[r, q])]
        steps += [Step({"s": 1, "t": 1}, computed={"s": 11 + i, "t": 6 + i}) for i in range(6)]
        outs = run_steps(make_worker(ARCH), steps, mode)
        return [t for o in outs for toks in o.sampled_token_ids for t in toks]
    assert tokens(False) == tokens(True)


def test_the_kv_cache_dtype_is_allocated_and_generates() -> None:
    worker = make_worker(ARCH, kv_cache_dtype="bfloat16")
    assert worker.model_runner.kv_caches[0][0].dtype == torch.bfloat16
    out = run_steps(worker, [Step({"a": 11}, new=[new_req("a", PROMPT_A, [0, 1, 2])])], False)
    assert len(out[0].sampled_token_ids[0]) == 1


def test_pending_tokens_copy_as_a_slice_only_when_both_index_lists_are_runs() -> None:
    import numpy as np

    from peregrine.worker.model_runner import _is_run
    assert _is_run(np.array([3])) and _is_run(np.array([4, 5, 6]))
    assert not _is_run(np.array([0, 2])) and not _is_run(np.array([0, 2, 1, 3]))
    assert not _is_run(np.array([2, 1, 0]))
