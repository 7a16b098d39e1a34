"""Verification keeps the target distribution: accept a one-hot draft x while the per-position
draw equals it (probability p(x)); on a mismatch the emitted token follows p without x,
renormalised; after an acceptance the next position is drawn from its own distribution."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from peregrine import LLM, SamplingParams
from peregrine.engine.request import Request
from peregrine.sample import Sampler, build_sampling_metadata
from peregrine.spec_decode.ngram import NgramProposer
from peregrine.spec_decode.verify import accepted_counts
from peregrine.testing.checkpoints import tiny_checkpoint

P_VALUE = 1e-3  # a correct rule fails one of these checks about once in 1,000 runs


def _fits(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Chi-square goodness of fit of `counts` to `probs` (over the tokens with p > 0)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    expected = probs[keep] / probs[keep].sum() * counts[keep].sum()
    return chisquare(counts[keep], expected).pvalue > P_VALUE


def _rows(num_seeds: int, **params) -> list[Request]:
    """Two sampler rows per seed: the position after the last token (step 0) and the next."""
    reqs = []
    for seed in range(num_seeds):
        for step in range(2):
            r = Request(f"r{seed}", [0], SamplingParams(**params), arrival_time=0.0,
                        eos_token_ids=(), max_tokens=100, seed=seed)
            r.output_token_ids = [1] * step  # keys position `step` of the random stream
            reqs.append(r)
    return reqs


def test_accepted_counts_counts_leading_matches() -> None:
    sampled = np.array([5, 6, 7, 1, 9, 4, 4])
    drafts = np.array([5, 6, -1, 2, -1, 4, -1])
    counts = np.array([3, 2, 2])
    assert accepted_counts(sampled, drafts, counts).tolist() == [2, 0, 1]
    # a mismatch stops the count even when later drafts match again
    assert accepted_counts(np.array([5, 0, 7, 3]), np.array([5, 1, 7, -1]),
                           np.array([4])).tolist() == [1]
    with pytest.raises(ValueError, match="logits rows expected"):
        accepted_counts(sampled[:3], drafts, counts)
    with pytest.raises(ValueError, match="must have draft -1"):
        accepted_counts(sampled, np.array([5, 6, 7, 2, -1, 4, -1]), counts)
    assert accepted_counts(np.zeros(0, np.int64), np.zeros(0, np.int64),
                           np.zeros(0, np.int64)).tolist() == []


def test_accepted_counts_of_random_rows_match_a_scan() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        counts = rng.integers(1, 10, rng.integers(1, 30))
        drafts = rng.integers(0, 3, counts.sum())
        drafts[np.cumsum(counts) - 1] = -1
        sampled = rng.integers(0, 3, counts.sum())
        want, f = [], 0
        for c in counts.tolist():
            m = 0
            while sampled[f + m] == drafts[f + m]:
                m += 1
            want.append(m)
            f += c
        assert accepted_counts(sampled, drafts, counts).tolist() == want


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)])
def test_one_hot_draft_keeps_the_target_distribution(params) -> None:
    n, draft = 6000, 2
    logits0 = torch.tensor([1.0, 0.2, 0.6, -0.5, 0.0])  # position after the last real token
    logits1 = torch.tensor([-0.3, 0.9, 0.1, 0.4, 0.0])  # the position after the draft
    reqs = _rows(n, **params)
    logits = torch.stack([logits0, logits1]).repeat(n, 1)  # (2n, V)
    meta = build_sampling_metadata(reqs, 5, "cpu")
    sampler = Sampler()
    out = sampler(logits, meta, return_probs=True)
    p0, p1 = out.probs[0].double().numpy(), out.probs[1].double().numpy()
    sampled = out.sampled_token_ids  # (2n,)
    acc = accepted_counts(sampled.numpy(), np.tile([draft, -1], n), np.full(n, 2))
    first = sampled[0::2].numpy()
    second = sampled[1::2].numpy()
    accepted = acc == 1
    assert np.array_equal(accepted, first == draft)
    # the emitted first token is distributed as p0 (accepted draft or the replacement)
    assert _fits(np.bincount(first, minlength=5), p0)
    # acceptance happens with probability p0(draft) (binomial, 4 standard deviations)
    assert abs(accepted.mean() - p0[draft]) < 4 * np.sqrt(p0[draft] * (1 - p0[draft]) / n)
    # on a rejection the token follows p0 without the draft, renormalised
    rej = np.bincount(first[~accepted], minlength=5)
    q = p0.copy()
    q[draft] = 0
    assert rej[draft] == 0
    assert _fits(rej, q)
    # after an acceptance the bonus token follows the next position's distribution
    assert _fits(np.bincount(second[accepted], minlength=5), p1)


def _next_logprobs(llm: LLM, prefix: list[int], tokens: list[int]) -> np.ndarray:
    """log p(t | prefix) for each t in `tokens`, from prompt logprobs of prefix + [t]."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([prefix + [t] for t in tokens], sp, use_tqdm=False)
    return np.array([o.prompt_logprobs[-1][t].logprob for o, t in zip(outs, tokens)])


def _softmax(lp: np.ndarray) -> np.ndarray:
    p = np.exp(lp - lp.max())
    return p / p.sum()


@pytest.mark.slow
def test_engine_with_a_fixed_draft_samples_the_target_distribution(monkeypatch) -> None:
    prompt = [(10 + 7 * i) % 500 + 5 for i in range(9)]
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=64,
              max_num_seqs=256, speculative_config={
                  "method": "ngram", "num_speculative_tokens": 1, "disable_by_batch_size": None})
    # Four tokens only (allowed_token_ids); the exact target: p(c) p(t | c) over 16 pairs.
    probe = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=4),
                         use_tqdm=False)[0].outputs[0].logprobs[0]
    top = sorted(probe, key=lambda t: -probe[t].logprob)[:4]
    joint = _softmax(_next_logprobs(llm, prompt, top))[:, None] * np.stack(
        [_softmax(_next_logprobs(llm, prompt + [c], top)) for c in top])  # (4, 4)
    draft = top[1]
    monkeypatch.setattr(NgramProposer, "propose", lambda self, inp: [[draft]] * len(inp.req_ids))
    before = llm.engine.get_stats()
    n = 800
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True,
                             allowed_token_ids=top) for s in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    # The first token is sampled plainly; the second is the draft, verified, or its replacement.
    pairs = np.array([[top.index(t) for t in o.outputs[0].token_ids[:2]] for o in outs])  # (n, 2)
    counts = np.bincount(pairs[:, 0] * 4 + pairs[:, 1], minlength=16)
    assert _fits(counts, joint.ravel())
    st = llm.engine.get_stats()
    verified = st.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = st.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert verified == n
    assert accepted == int((pairs[:, 1] == 1).sum())
