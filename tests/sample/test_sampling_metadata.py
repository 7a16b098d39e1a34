"""build_sampling_metadata: per-row tensors and the host flags the sampler branches on."""
from __future__ import annotations

import pytest
import torch
from sample_helpers import make_request

from peregrine.sample import build_sampling_metadata
from peregrine.sample.metadata import seed_to_int64


def test_per_row_values_and_greedy_rows_neutralised():
    reqs = [make_request(seed=1, temperature=0.0, top_k=5, top_p=0.5, min_p=0.3),
            make_request(seed=2, output=[4, 4], temperature=0.7, top_k=3, top_p=0.9, min_p=0.1)]
    m = build_sampling_metadata(reqs, 10, "cpu")
    assert m.temperature.tolist() == pytest.approx([1.0, 0.7])
    assert m.top_k.tolist() == [1, 3]
    assert m.top_p.tolist() == pytest.approx([1.0, 0.9])
    assert m.min_p.tolist() == pytest.approx([0.0, 0.1])
    assert m.seeds.tolist() == [1, 2] and m.steps.tolist() == [0, 2]
    assert m.greedy_mask.tolist() == [True, False]


def test_flags_for_an_all_greedy_batch():
    m = build_sampling_metadata([make_request(temperature=0.0, top_p=0.5)] * 3, 10, "cpu")
    assert m.all_greedy and not (m.any_top_k or m.any_top_p or m.any_min_p or m.any_penalties)
    assert m.max_num_logprobs is None


def test_flags_come_from_sampled_rows_only():
    reqs = [make_request(temperature=0.0, top_k=4), make_request(top_k=0, top_p=0.8), make_request(top_k=50)]
    m = build_sampling_metadata(reqs, 30, "cpu")
    assert not m.all_greedy and m.any_top_k and not m.all_top_k and m.any_top_p and not m.any_min_p
    assert m.max_top_k == 30  # clamped to the vocabulary


def test_all_top_k_when_every_sampled_row_has_one():
    m = build_sampling_metadata([make_request(top_k=4), make_request(temperature=0.0),
                                 make_request(top_k=9)], 30, "cpu")
    assert m.all_top_k and m.max_top_k == 9 and m.greedy_mask is not None


def test_no_penalty_tensors_without_penalties():
    m = build_sampling_metadata([make_request(prompt=[1, 2], output=[3])], 10, "cpu")
    assert m.prompt_token_mask is None and m.output_token_counts is None and m.repetition_penalties is None


def test_penalty_counts_only_for_rows_that_use_penalties():
    reqs = [make_request(prompt=[1, 2, 2], output=[3, 3, 7], frequency_penalty=0.5),
            make_request(prompt=[4], output=[5])]
    m = build_sampling_metadata(reqs, 8, "cpu")
    assert m.any_penalties and m.any_presence_frequency and not m.any_repetition_penalty
    assert m.penalty_rows.tolist() == [0] and m.frequency_penalties.tolist() == [0.5]
    slots = m.penalty_slots
    assert m.prompt_token_mask[slots].tolist() == [[False, True, True] + [False] * 5]
    assert m.output_token_counts[slots].tolist() == [[0, 0, 0, 2, 0, 0, 0, 1]]


def test_min_tokens_bans_listed_per_row():
    reqs = [make_request(output=[1], min_tokens=2, eos=(9, 8), stop_token_ids=[3]),
            make_request(output=[1, 1], min_tokens=2, eos=(9,)),
            make_request(min_tokens=1, eos=(9,), ignore_eos=True, stop_token_ids=[3, 50])]
    m = build_sampling_metadata(reqs, 10, "cpu")
    pairs = sorted(zip(m.banned_rows.tolist(), m.banned_tokens.tolist()))
    assert m.any_min_tokens and pairs == [(0, 3), (0, 8), (0, 9), (2, 3)]


def test_max_num_logprobs_is_the_batch_maximum():
    reqs = [make_request(logprobs=2), make_request(), make_request(logprobs=0)]
    assert build_sampling_metadata(reqs, 10, "cpu").max_num_logprobs == 2
    assert build_sampling_metadata([make_request(logprobs=0)], 10, "cpu").max_num_logprobs == 0


def test_seeds_wrap_to_int64():
    assert seed_to_int64(2**64 - 1) == -1 and seed_to_int64(2**63) == -(2**63) and seed_to_int64(-5) == -5
    m = build_sampling_metadata([make_request(seed=2**64 + 3)], 10, "cpu")
    assert m.seeds.dtype == torch.int64 and m.seeds.tolist() == [3]


def test_empty_batch_is_rejected():
    with pytest.raises(ValueError, match="at least one request"):
        build_sampling_metadata([], 10, "cpu")


def test_rows_are_the_same_alone_in_a_uniform_batch_and_in_a_mixed_batch():
    params = [dict(temperature=0.6), dict(temperature=0.0, top_k=5, top_p=0.5),
              dict(top_k=50, top_p=0.8, min_p=0.1),
              dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.25, temperature=1.7)]
    reqs = [make_request(seed=i - 2, output=[1] * i, **params[i]) for i in range(4)]
    mixed = build_sampling_metadata(reqs, 30, "cpu")
    fields = ("temperature", "top_k", "top_p", "min_p", "seeds", "steps")
    for i, req in enumerate(reqs):
        alone = build_sampling_metadata([req], 30, "cpu")
        uniform = build_sampling_metadata([req] * 3, 30, "cpu")
        for name in fields:
            want = getattr(mixed, name)[i].item()
            if name == "steps" and alone.all_greedy:  # a greedy row alone draws nothing
                assert alone.steps is None and uniform.steps is None
                continue
            assert getattr(alone, name).tolist() == [want] and getattr(uniform, name).tolist() == [want] * 3
    assert mixed.greedy_mask.tolist() == [False, True, False, False]
    assert mixed.penalty_rows.tolist() == [3]
    assert mixed.repetition_penalties.tolist() == pytest.approx([1.3])
    assert mixed.presence_penalties.tolist() == pytest.approx([0.5])
    assert mixed.frequency_penalties.tolist() == pytest.approx([-0.25])
    assert mixed.temperature.tolist() == pytest.approx([0.6, 1.0, 1.0, 1.7])


def test_uniform_greedy_batch_gets_neutral_values():
    m = build_sampling_metadata([make_request(seed=s, temperature=0.0, top_k=3, min_p=0.2) for s in range(3)],
                                10, "cpu")
    assert m.all_greedy and m.greedy_mask.tolist() == [True] * 3
    assert m.temperature.tolist() == [1.0] * 3 and m.top_k.tolist() == [1] * 3
    assert m.min_p.tolist() == [0.0] * 3


def test_explicit_steps_override_the_output_count():
    reqs = [make_request(seed=1, output=[4, 4], min_tokens=3, eos=(9,)),
            make_request(seed=2, min_tokens=3, eos=(9,))]
    m = build_sampling_metadata(reqs, 10, "cpu", steps=[5, 2])  # e.g. tokens still in flight
    assert m.steps.tolist() == [5, 2]
    assert m.banned_rows.tolist() == [1] and m.banned_tokens.tolist() == [9]  # row 0 is past min_tokens
    with pytest.raises(ValueError, match="steps"):
        build_sampling_metadata(reqs, 10, "cpu", steps=[1])


def test_all_greedy_steps_send_no_draw_keys_but_keep_min_tokens_bans():
    reqs = [make_request(seed=1, temperature=0.0), make_request(seed=2, temperature=0.0,
                                                                min_tokens=3, eos=(9,))]
    m = build_sampling_metadata(reqs, 10, "cpu", steps=[4, 5])
    assert m.all_greedy and m.steps is None and m.banned_rows is None
    m = build_sampling_metadata(reqs, 10, "cpu", steps=[4, 1])  # row 1 is below min_tokens
    assert m.steps.tolist() == [4, 1]
    assert m.banned_rows.tolist() == [1] and m.banned_tokens.tolist() == [9]
