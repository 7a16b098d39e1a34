"""SamplingParams: bad values raise ValueError naming the parameter; normalisation of stop and top_k."""
from __future__ import annotations

import pytest

from peregrine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams

_BAD = [
    ("n", 0), ("n", 1.5),
    ("temperature", -0.1),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.01), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("prompt_logprobs", -2),
    ("stop", ["ok", ""]), ("stop", ""), ("stop", ["ok", 5]),
    ("stop", [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]),
    ("stop", ["x" * (MAX_STOP_STRING_CHARS + 1)]),
    ("stop_token_ids", [1, -1]), ("stop_token_ids", ["2"]),
    ("seed", 1.5), ("seed", "7"),
]


@pytest.mark.parametrize(("name", "value"), _BAD)
def test_bad_value_raises_value_error_naming_the_parameter(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_min_tokens_without_max_tokens_is_allowed():
    assert SamplingParams(min_tokens=10, max_tokens=None).min_tokens == 10


@pytest.mark.parametrize(("name", "value"), [("temperature", 0.0), ("top_p", 1.0), ("top_k", 0), ("top_k", 40),
                                             ("min_p", 1.0), ("presence_penalty", -2.0),
                                             ("frequency_penalty", 2.0), ("repetition_penalty", 1.3),
                                             ("max_tokens", 1), ("logprobs", 0), ("seed", -5)])
def test_boundary_values_are_accepted(name, value):
    assert getattr(SamplingParams(**{name: value}), name) == value


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0


def test_greedy_below_temperature_epsilon():
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams(temperature=0.5).is_greedy


def test_generation_defaults_fill_only_unset_fields():
    params = SamplingParams(top_p=0.5)
    updated = params.with_generation_defaults({"temperature": 0.6, "top_p": 0.9, "top_k": 20}, {"top_p"})
    assert (updated.temperature, updated.top_p, updated.top_k) == (0.6, 0.5, 20)


def test_generation_do_sample_false_means_greedy_unless_user_set_temperature():
    assert SamplingParams().with_generation_defaults({"do_sample": False}, set()).is_greedy
    kept = SamplingParams(temperature=0.8).with_generation_defaults({"do_sample": False}, {"temperature"})
    assert kept.temperature == 0.8


def test_stop_strings_at_the_limits_are_accepted():
    stop = ["x" * MAX_STOP_STRING_CHARS] + [f"s{i}" for i in range(MAX_STOP_STRINGS - 1)]
    assert len(SamplingParams(stop=stop).stop) == MAX_STOP_STRINGS
