"""SamplingParams: bad values raise ValueError naming the parameter; normalisation of stop and top_k."""
from __future__ import annotations

import pytest

from peregrine.sampling_params import (MAX_BAD_WORD_CHARS, MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS,
                                       MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams)

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
    ("allowed_token_ids", []), ("allowed_token_ids", [1, -1]), ("allowed_token_ids", [True]),
    ("allowed_token_ids", ["3"]), ("allowed_token_ids", 5), ("allowed_token_ids", {1: 2}),
    ("bad_words", "word"), ("bad_words", ["ok", ""]), ("bad_words", ["ok", 3]),
    ("bad_words", [f"w{i}" for i in range(MAX_BAD_WORDS + 1)]),
    ("bad_words", ["x" * (MAX_BAD_WORD_CHARS + 1)]),
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


def test_allowed_token_ids_and_bad_words_accept_tuples_as_lists():
    p = SamplingParams(allowed_token_ids=(3, 1), bad_words=("a", "b c"))
    assert p.allowed_token_ids == [3, 1] and p.bad_words == ["a", "b c"]


def test_bad_words_are_encoded_as_is_and_after_a_space_once_each():
    encode = {"ab": [1, 2], " ab": [7, 2], "c": [3], " c": [3]}.__getitem__
    p = SamplingParams(bad_words=["ab", "c"]).with_bad_word_tokens(encode)
    assert p._bad_words_token_ids == [[1, 2], [7, 2], [3]]
    assert p.bad_words == ["ab", "c"]


def test_params_without_bad_words_hold_no_token_sequences():
    assert SamplingParams().with_bad_word_tokens(lambda s: [1])._bad_words_token_ids is None


@pytest.mark.parametrize("ids", [[], list(range(MAX_BAD_WORD_TOKENS + 1))])
def test_a_bad_word_with_no_or_too_many_tokens_is_rejected(ids):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["w"]).with_bad_word_tokens(lambda s: ids)


def test_detokenize_is_a_boolean_and_stop_strings_need_it() -> None:
    assert SamplingParams().detokenize is True
    assert SamplingParams(detokenize=False, stop_token_ids=[3]).detokenize is False
    with pytest.raises(ValueError, match="detokenize must be a boolean"):
        SamplingParams(detokenize=1)
    with pytest.raises(ValueError, match="stop strings are matched on the output text"):
        SamplingParams(detokenize=False, stop=["\n"])
