"""Logprobs and ranks: exact against torch.log_softmax of the raw logits."""
from __future__ import annotations

import torch
from sample_helpers import make_request, rng, sample

from peregrine.sample import compute_token_logprobs
from peregrine.sample import logprobs as logprobs_module


def test_token_logprobs_match_log_softmax():
    logits = torch.randn(5, 300, generator=rng())
    target = torch.tensor([0, 10, 299, 7, 150])
    ids, lps, ranks = compute_token_logprobs(logits, target, 4)
    ref = torch.log_softmax(logits, -1)
    assert torch.equal(ids[:, 0], target)
    assert torch.equal(lps[:, 0], ref.gather(1, target[:, None]).squeeze(1))
    top_lp, top_ids = ref.topk(4, dim=-1)
    assert torch.equal(ids[:, 1:], top_ids) and torch.equal(lps[:, 1:], top_lp)
    assert torch.equal(ranks, (ref > ref.gather(1, target[:, None])).sum(-1) + 1)


def test_rank_counts_only_strictly_larger_logprobs():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 2.0]])
    _, _, ranks = compute_token_logprobs(logits.repeat(3, 1), torch.tensor([1, 2, 4]), 0)
    assert ranks.tolist() == [1, 1, 3]


def test_zero_k_returns_only_the_target_column():
    ids, lps, ranks = compute_token_logprobs(torch.randn(3, 10, generator=rng()), torch.tensor([1, 2, 3]), 0)
    assert ids.shape == (3, 1) and lps.shape == (3, 1) and ranks.shape == (3,)


def test_chunked_rows_equal_unchunked(monkeypatch):
    logits = torch.randn(37, 64, generator=rng())
    target = torch.randint(0, 64, (37,), generator=rng())
    whole = compute_token_logprobs(logits, target, 3)
    monkeypatch.setattr(logprobs_module, "_MAX_CHUNK_ELEMENTS", 64 * 5)
    chunked = compute_token_logprobs(logits, target, 3)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


def test_sampler_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(4, 200, generator=rng())
    reqs = [make_request(seed=i, output=[3], temperature=0.5, top_k=10, repetition_penalty=1.7, logprobs=k)
            for i, k in enumerate([0, 2, 5, None])]
    out = sample(logits, reqs)
    ref = torch.log_softmax(logits, -1)
    assert out.logprob_token_ids.shape == (4, 6) and out.logprobs.shape == (4, 6)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.equal(out.logprobs[:, 0], ref.gather(1, out.sampled_token_ids[:, None]).squeeze(1))
    assert torch.equal(out.logprobs[:, 1:], ref.topk(5, dim=-1).values)
    expected_ranks = (ref > ref.gather(1, out.sampled_token_ids[:, None])).sum(-1) + 1
    assert torch.equal(out.ranks, expected_ranks)


def test_no_logprobs_requested_returns_none():
    out = sample(torch.randn(2, 20, generator=rng()), [make_request(), make_request(seed=1)])
    assert out.logprob_token_ids is None and out.logprobs is None and out.ranks is None


def test_bfloat16_logits_are_accepted():
    logits = torch.randn(3, 50, generator=rng()).bfloat16()
    out = sample(logits, [make_request(seed=i, logprobs=1) for i in range(3)])
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
