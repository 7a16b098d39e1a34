"""Penalties and min_tokens change exactly the logits they should, by exactly the specified amounts."""
from __future__ import annotations

import torch
from sample_helpers import make_request, sample

from peregrine.sample import Sampler, build_sampling_metadata

_LOGITS = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])


def _penalised(reqs, logits=_LOGITS) -> torch.Tensor:
    return Sampler.apply_penalties(logits.clone(), build_sampling_metadata(reqs, logits.shape[-1], "cpu"))


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    req = make_request(prompt=[0, 1], output=[2, 2, 3], repetition_penalty=2.0)
    expected = torch.tensor([[1.0, -4.0, 0.5, -2.0, 0.5, 3.0]])  # tokens 0..3 seen; 4, 5 untouched
    assert torch.equal(_penalised([req]), expected)


def test_presence_and_frequency_penalties_use_output_counts_only():
    req = make_request(prompt=[4, 5], output=[0, 0, 0, 1], presence_penalty=0.5, frequency_penalty=0.25)
    # token 0: 2 - 3*0.25 - 0.5 = 0.75; token 1: -2 - 0.25 - 0.5 = -2.75; prompt tokens 4, 5 untouched.
    expected = torch.tensor([[0.75, -2.75, 1.0, -1.0, 0.5, 3.0]])
    assert torch.equal(_penalised([req]), expected)


def test_negative_presence_penalty_rewards_repeats():
    req = make_request(output=[1], presence_penalty=-1.0)
    assert torch.equal(_penalised([req])[0, 1], torch.tensor(-1.0))


def test_repetition_then_frequency_in_order():
    req = make_request(prompt=[5], output=[5], repetition_penalty=2.0, frequency_penalty=1.0)
    # repetition first: 3 / 2 = 1.5, then frequency: 1.5 - 1 = 0.5.
    assert torch.equal(_penalised([req])[0, 5], torch.tensor(0.5))


def test_penalties_leave_other_rows_untouched():
    logits = _LOGITS.repeat(2, 1)
    reqs = [make_request(prompt=[0], output=[1], repetition_penalty=1.5, presence_penalty=1.0),
            make_request(seed=1, prompt=[0], output=[1])]
    out = _penalised(reqs, logits)
    assert torch.equal(out[1], _LOGITS[0])
    assert not torch.equal(out[0], _LOGITS[0])


def test_penalties_do_not_modify_callers_logits():
    logits = _LOGITS.clone()
    req = make_request(output=[0], repetition_penalty=3.0, min_tokens=2, eos=(5,))
    sample(logits, [req])
    assert torch.equal(logits, _LOGITS)


def test_greedy_uses_penalised_logits():
    req = make_request(prompt=[3], output=[5], temperature=0.0, repetition_penalty=10.0)
    assert int(sample(_LOGITS, [req]).sampled_token_ids[0]) == 0  # 5 drops to 0.3; 0 (2.0) wins


def test_min_tokens_bans_eos_and_stop_token_ids():
    req = make_request(output=[0], min_tokens=3, eos=(5,), stop_token_ids=[2])
    out = _penalised([req])
    assert out[0, 5] == float("-inf") and out[0, 2] == float("-inf")
    assert torch.equal(out[0, [0, 1, 3, 4]], _LOGITS[0, [0, 1, 3, 4]])


def test_min_tokens_with_ignore_eos_still_bans_stop_token_ids():
    req = make_request(output=[], min_tokens=2, eos=(5,), stop_token_ids=[2], ignore_eos=True)
    out = _penalised([req])
    assert out[0, 5] == 3.0 and out[0, 2] == float("-inf")


def test_min_tokens_lifted_once_reached():
    req = make_request(output=[0, 1, 4], min_tokens=3, eos=(5,))
    assert torch.equal(_penalised([req]), _LOGITS)


def test_min_tokens_prevents_sampling_eos():
    logits = torch.tensor([[0.0, 0.0, 0.0, 20.0]])  # eos (3) would be chosen almost surely
    for seed in range(50):
        req = make_request(seed=seed, min_tokens=1, eos=(3,))
        assert int(sample(logits, [req]).sampled_token_ids[0]) != 3
    greedy = make_request(temperature=0.0, min_tokens=1, eos=(3,))
    assert int(sample(logits, [greedy]).sampled_token_ids[0]) != 3


def test_out_of_range_token_ids_are_ignored_by_penalties_and_bans():
    req = make_request(prompt=[0, 99], output=[77], repetition_penalty=2.0, min_tokens=1, eos=(123,))
    out = _penalised([req])
    assert torch.equal(out, torch.tensor([[1.0, -2.0, 1.0, -1.0, 0.5, 3.0]]))


def test_logit_bias_adds_exactly_its_values_to_its_row():
    logits = _LOGITS.repeat(2, 1)
    reqs = [make_request(logit_bias={1: 5.0, 5: -3.0}), make_request(seed=1)]
    out = _penalised(reqs, logits)
    expected = _LOGITS[0].clone()
    expected[1] += 5.0
    expected[5] -= 3.0
    assert torch.equal(out[0], expected)
    assert torch.equal(out[1], _LOGITS[0])


def test_logit_bias_decides_greedy_and_random_draws_and_min_tokens_still_bans():
    # +100 makes token 1 win every draw; -100 on the argmax (token 5) moves greedy to token 0.
    for temperature in (0.0, 1.0):
        for seed in range(5):
            req = make_request(seed=seed, logit_bias={1: 100.0}, temperature=temperature)
            assert sample(_LOGITS, [req]).sampled_token_ids.item() == 1
    req = make_request(logit_bias={5: -100.0}, temperature=0.0)
    assert sample(_LOGITS, [req]).sampled_token_ids.item() == 0
    # min_tokens bans the stop token even with a bias towards it.
    req = make_request(logit_bias={1: 100.0}, temperature=0.0, min_tokens=3, stop_token_ids=[1])
    assert sample(_LOGITS, [req]).sampled_token_ids.item() == 5


def test_logit_bias_is_validated():
    import pytest

    from peregrine.sampling_params import SamplingParams
    for bad in ({-1: 1.0}, {"3": 1.0}, {3: 100.5}, {3: float("nan")}, [3]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_fused_kernel_applies_the_logit_bias_like_the_torch_path():
    from sample_helpers import rng
    logits = torch.randn(4, 64, generator=rng())
    reqs = [make_request(seed=s, logit_bias={7: 4.0, 9: -2.5, 60: 1.5}, temperature=t)
            for s, t in ((0, 0.0), (1, 0.7), (2, 1.0), (3, 1.3))]
    got = sample(logits, reqs, Sampler(use_kernel=True)).sampled_token_ids
    want = sample(logits, reqs, Sampler(use_kernel=False)).sampled_token_ids
    assert torch.equal(got, want)
