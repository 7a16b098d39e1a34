"""Greedy, top-k, top-p and min-p: every draw stays inside the set an independent oracle allows."""
from __future__ import annotations

import pytest
import torch
from sample_helpers import make_request, rng, sample

from peregrine.sample import Sampler


def _allowed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """(V,) bool oracle: vLLM semantics (top-k, then top-p on the renormalised rest, then min-p)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)  # (V,)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = top_k if top_k > 0 else probs.numel()
    kept = order[:k]
    p = probs[kept] / probs[kept].sum()
    cum = torch.cumsum(p, 0)
    n = int((cum < top_p).sum()) + 1 if top_p < 1.0 else k
    kept = kept[:min(n, k)]
    keep[kept] = True
    keep &= probs >= min_p * probs.max()
    return keep


def _draw_many(logits_row: torch.Tensor, n: int, **params) -> torch.Tensor:
    """n draws of one logits row, each from a different seed (one batched call)."""
    reqs = [make_request(seed=s, **params) for s in range(n)]
    return sample(logits_row.expand(n, -1).contiguous(), reqs).sampled_token_ids


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(16, 500, generator=rng())
    reqs = [make_request(seed=i, temperature=0.0 if i % 2 == 0 else 1.0) for i in range(16)]
    out = sample(logits, reqs).sampled_token_ids
    assert torch.equal(out[::2], logits[::2].argmax(-1))


def test_all_greedy_batch_ignores_filters_and_returns_argmax():
    logits = torch.randn(8, 300, generator=rng())
    reqs = [make_request(seed=i, temperature=0.0, top_k=3, top_p=0.1) for i in range(8)]
    assert torch.equal(sample(logits, reqs).sampled_token_ids, logits.argmax(-1))


@pytest.mark.parametrize("top_k", [1, 5, 40])
def test_top_k_compact_path_stays_in_top_k(top_k):
    logits = torch.randn(1000, generator=rng())
    draws = _draw_many(logits, 400, top_k=top_k)
    allowed = set(logits.topk(top_k).indices.tolist())
    assert set(draws.tolist()) <= allowed


def test_top_k_mixed_with_unfiltered_rows_stays_in_top_k():
    logits = torch.randn(400, 1000, generator=rng())
    reqs = [make_request(seed=s, top_k=7 if s % 2 == 0 else 0) for s in range(400)]
    out = sample(logits, reqs).sampled_token_ids
    topk = logits.topk(7, dim=-1).indices  # (B, 7)
    assert bool((topk[::2] == out[::2, None]).any(-1).all())


def test_top_k_above_compact_limit_uses_sort_and_stays_in_top_k():
    sampler = Sampler()
    sampler.max_compact_top_k = 4
    logits = torch.randn(300, 200, generator=rng())
    reqs = [make_request(seed=s, top_k=10) for s in range(300)]
    out = sample(logits, reqs, sampler).sampled_token_ids
    assert bool((logits.topk(10, dim=-1).indices == out[:, None]).any(-1).all())


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9])
def test_top_p_stays_in_nucleus(top_p):
    logits = torch.randn(500, generator=rng()) * 2
    allowed = _allowed(logits, 1.0, 0, top_p, 0.0)
    draws = _draw_many(logits, 400, top_p=top_p)
    assert bool(allowed[draws].all())


def test_min_p_stays_above_ratio():
    logits = torch.randn(500, generator=rng()) * 2
    allowed = _allowed(logits, 0.7, 0, 1.0, 0.2)
    draws = _draw_many(logits, 400, temperature=0.7, min_p=0.2)
    assert bool(allowed[draws].all())


@pytest.mark.parametrize("compact", [True, False])
def test_combined_filters_match_oracle(compact):
    sampler = Sampler()
    if not compact:
        sampler.max_compact_top_k = 0  # force the full-vocabulary sort path
    logits = torch.randn(200, generator=rng()) * 3
    allowed = _allowed(logits, 0.8, 20, 0.8, 0.05)
    reqs = [make_request(seed=s, temperature=0.8, top_k=20, top_p=0.8, min_p=0.05) for s in range(500)]
    out = sample(logits.expand(500, -1).contiguous(), reqs, sampler).sampled_token_ids
    assert bool(allowed[out].all())
    # Enough draws to see every allowed token that has >= ~2% mass.
    probs = torch.softmax(logits / 0.8, -1) * allowed
    probs /= probs.sum()
    assert set(torch.nonzero(probs > 0.02).flatten().tolist()) <= set(out.tolist())


def test_every_row_respects_its_own_filters():
    logits = torch.randn(6, 300, generator=rng()) * 2
    params = [dict(temperature=0.0), dict(top_k=3), dict(top_p=0.3), dict(min_p=0.5),
              dict(top_k=50, top_p=0.6), dict()]
    for trial in range(30):
        reqs = [make_request(seed=trial * 10 + i, **p) for i, p in enumerate(params)]
        out = sample(logits, reqs).sampled_token_ids
        for i, p in enumerate(params):
            if p.get("temperature") == 0.0:
                assert int(out[i]) == int(logits[i].argmax())
            else:
                allowed = _allowed(logits[i], 1.0, p.get("top_k", 0), p.get("top_p", 1.0), p.get("min_p", 0.0))
                assert bool(allowed[out[i]])


def test_neg_inf_logits_are_never_sampled_and_give_no_nan():
    logits = torch.randn(4, 100, generator=rng())
    logits[:, ::2] = float("-inf")
    logits[3, :98] = float("-inf")  # only tokens 98 (banned: even) and 99 remain -> 99
    params = [dict(), dict(top_p=0.5), dict(top_k=80), dict(min_p=0.1, logprobs=3)]
    for trial in range(20):
        reqs = [make_request(seed=trial * 4 + i, **p) for i, p in enumerate(params)]
        out = sample(logits, reqs)
        assert bool(torch.isfinite(logits.gather(1, out.sampled_token_ids[:, None])).all())
        assert int(out.sampled_token_ids[3]) == 99
        assert not bool(torch.isnan(out.logprobs).any())
        assert bool(torch.isfinite(out.logprobs[:, 0]).all())


def test_single_kept_token_is_always_chosen():
    logits = torch.randn(2000, 50, generator=rng())
    reqs = [make_request(seed=s, top_k=1) for s in range(2000)]
    assert torch.equal(sample(logits, reqs).sampled_token_ids, logits.argmax(-1))
