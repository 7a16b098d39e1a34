"""allowed_token_ids and bad_words: the sampler's bans equal a plain-Python statement of the rule,
over many steps of a changing batch whose recent tokens live only on the device."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from sample_helpers import make_request, rng, sample

from peregrine.sample import Sampler, SamplingRows, build_sampling_metadata
from peregrine.sample.constraints import AllowedTokenPool, RecentTokenPool
from peregrine.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams

_INF = float("-inf")


def _params(allowed: list[int] | None = None, bad: list[list[int]] | None = None,
            **kw) -> SamplingParams:
    """Params whose bad words are already token sequences (what the front end sends)."""
    if bad is None:
        return SamplingParams(allowed_token_ids=allowed, **kw)
    return SamplingParams(allowed_token_ids=allowed, bad_words=["w"], _bad_words_token_ids=bad, **kw)


def _reference(logits: torch.Tensor, allowed: list[int] | None, bad: list[list[int]] | None,
               output: list[int]) -> torch.Tensor:
    """The rule, one token at a time: outside `allowed` is -inf; a bad sequence's last token is
    -inf when the output so far ends with the sequence's other tokens (always, for one token)."""
    out = logits.clone()
    for v in range(out.shape[0]):
        if allowed is not None and v not in allowed:
            out[v] = _INF
    for seq in bad or []:
        prefix = seq[:-1]
        if len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix:
            out[seq[-1]] = _INF
    return out


def _apply(logits: torch.Tensor, reqs: list) -> torch.Tensor:
    return Sampler.apply_penalties(logits.clone(), build_sampling_metadata(reqs, logits.shape[-1], "cpu"))


# ---- one step -------------------------------------------------------------------------------------
def test_allowed_token_ids_keep_only_the_listed_logits():
    logits = torch.randn(2, 8, generator=rng())
    reqs = [make_request(allowed_token_ids=[1, 6, 6]), make_request(seed=1)]
    out = _apply(logits, reqs)
    expected = torch.full((8,), _INF)
    expected[[1, 6]] = logits[0, [1, 6]]
    assert torch.equal(out[0], expected)
    assert torch.equal(out[1], logits[1])


def test_allowed_token_ids_restrict_greedy_and_random_draws():
    logits = torch.randn(64, 50, generator=rng(3))
    allowed = [3, 17, 41]
    reqs = [make_request(seed=i, temperature=0.0 if i % 2 else 1.0, allowed_token_ids=allowed)
            for i in range(64)]
    tokens = sample(logits, reqs).sampled_token_ids.tolist()
    assert set(tokens) <= set(allowed)
    assert len(set(tokens)) > 1


def test_a_one_token_bad_word_is_always_banned():
    logits = torch.randn(1, 6, generator=rng())
    req = make_request()
    req.sampling_params = _params(bad=[[4], [2]])
    out = _apply(logits, [req])
    assert out[0, 4] == _INF and out[0, 2] == _INF
    assert torch.equal(out[0, [0, 1, 3, 5]], logits[0, [0, 1, 3, 5]])


@pytest.mark.parametrize(("output", "banned"), [
    ([], False), ([7], False), ([1], True), ([1, 2], False), ([9, 2, 1], True), ([1, 1], True)])
def test_a_two_token_bad_word_bans_its_last_token_after_its_first(output, banned):
    logits = torch.zeros(1, 10)
    req = make_request(prompt=[1], output=output)  # the prompt never counts
    req.sampling_params = _params(bad=[[1, 5]])
    out = _apply(logits, [req])
    assert (out[0, 5] == _INF) == banned
    assert torch.equal(out[0, [0, 1, 2, 3, 4, 6, 7, 8, 9]], torch.zeros(9))


def test_a_long_resumed_output_fills_the_window_with_its_tail():
    history = [3] * 100 + list(range(MAX_BAD_WORD_TOKENS - 1))  # only the tail fits the window
    seq = list(range(MAX_BAD_WORD_TOKENS - 1)) + [9]
    req = make_request(output=history)
    req.sampling_params = _params(bad=[seq, [3, 3, 8]])
    out = _apply(torch.zeros(1, MAX_BAD_WORD_TOKENS + 10), [req])
    assert out[0, 9] == _INF and out[0, 8] == 0.0


def test_constraints_stack_with_logit_bias_and_penalties():
    logits = torch.randn(1, 8, generator=rng(5))
    req = make_request(output=[2, 3], presence_penalty=0.5, logit_bias={4: 10.0, 5: 3.0})
    req.sampling_params = _params(allowed=[2, 4, 5], bad=[[3, 4]], presence_penalty=0.5,
                                  logit_bias={4: 10.0, 5: 3.0})
    out = _apply(logits, [req])[0]
    assert out[4] == _INF  # banned despite the bias
    assert out[5] == logits[0, 5] + 3.0
    assert out[2] == logits[0, 2] - 0.5
    assert torch.isinf(out[[0, 1, 3, 6, 7]]).all()
    assert Sampler()(logits, build_sampling_metadata([req], 8, "cpu")).sampled_token_ids.item() in (2, 5)


def test_logprobs_stay_those_of_the_raw_logits():
    logits = torch.randn(1, 8, generator=rng(6))
    plain = sample(logits, [make_request(logprobs=3, temperature=0.0)])
    masked = sample(logits, [make_request(logprobs=3, temperature=0.0, allowed_token_ids=[0, 1])])
    assert masked.sampled_token_ids.item() in (0, 1)
    raw = torch.log_softmax(logits, -1)[0]
    assert torch.allclose(masked.logprobs[0, 0], raw[masked.sampled_token_ids.item()])
    assert torch.equal(masked.logprobs[0, 1:], plain.logprobs[0, 1:])


def test_rows_without_constraints_carry_no_constraint_tensors():
    meta = build_sampling_metadata([make_request(), make_request(seed=1, logit_bias={1: 1.0})], 8, "cpu")
    assert not (meta.any_allowed_tokens or meta.any_bad_words)
    assert meta.allowed_rows is None and meta.bad_word_rows is None and meta.recent_rows is None
    assert not build_sampling_metadata([make_request()], 8, "cpu").changes_logits


def test_untokenized_bad_words_are_refused_by_the_sampler():
    req = make_request(bad_words=["oops"])
    with pytest.raises(ValueError, match="untokenized"):
        build_sampling_metadata([req], 8, "cpu")


# ---- many steps of a changing batch -------------------------------------------------------------
class _Row:
    def __init__(self, allowed, bad, output):
        self.allowed, self.bad, self.output = allowed, bad, list(output)


def _random_constraints(r: random.Random, vocab: int, alphabet: int):
    allowed = bad = None
    kind = r.randrange(4)  # none, allowed, bad, both
    if kind in (1, 3):
        allowed = r.sample(range(vocab), r.randint(1, vocab // 2))
    if kind in (2, 3):
        bad = [[r.randrange(alphabet) for _ in range(r.randint(1, 4))] for _ in range(r.randint(1, 4))]
    return allowed, bad


@pytest.mark.parametrize("seed", range(4))
def test_many_steps_of_a_changing_batch_match_the_reference(seed):
    # NOTE: a small alphabet of emitted tokens makes prefixes match often; the emitted tokens are
    # chosen here, not drawn, so that every branch of the rule is reached. Rows come and go
    # (resumes with earlier output), and the batch is condensed, as the worker does.
    r = random.Random(seed)
    vocab, alphabet, max_rows = 12, 3, 6
    rows = SamplingRows(max_rows, vocab, "cpu")
    live: dict[int, _Row] = {}
    checked_bans = 0
    for step in range(60):
        if len(live) < max_rows and r.random() < 0.4:
            row = min(set(range(max_rows)) - set(live))
            allowed, bad = _random_constraints(r, vocab, alphabet)
            output = [r.randrange(alphabet) for _ in range(r.choice([0, 0, 2, 70]))]
            live[row] = _Row(allowed, bad, output)
            rows.add_row(row, _params(allowed, bad), row, (), [0], output)
        if live and r.random() < 0.15:
            row = r.choice(sorted(live))
            rows.remove_row(row)
            del live[row]
        if live and r.random() < 0.2:  # condense: the last row moves into the lowest hole
            holes = sorted(set(range(max(live) + 1)) - set(live))
            if holes:
                src = max(live)
                rows.move_row(src, holes[0])
                live[holes[0]] = live.pop(src)
        if not live:
            continue
        order = np.array(r.sample(sorted(live), len(live)), np.int64)  # any sampler-row order
        steps = np.array([len(live[int(b)].output) for b in order], np.int64)
        meta = rows.metadata(order, steps)
        logits = torch.randn(len(order), vocab, generator=rng(step))
        got = Sampler.apply_penalties(logits, meta)
        for i, b in enumerate(order.tolist()):
            want = _reference(logits[i], live[b].allowed, live[b].bad, live[b].output)
            assert torch.equal(got[i], want), (step, b, live[b].bad, live[b].output[-4:])
            checked_bans += int(torch.isinf(want).sum())
        emitted = torch.tensor([r.randrange(alphabet) for _ in order], dtype=torch.int64)
        rows.record_sampled(meta, emitted)
        for b, tok in zip(order.tolist(), emitted.tolist()):
            live[b].output.append(tok)
    assert checked_bans > 50


def test_the_sampler_never_completes_a_bad_word_over_many_steps():
    # The sampled tensor feeds the windows, as in the engine: greedy rows would pick the bad
    # continuation every time without the ban (it has the highest logit).
    vocab = 10
    seqs = [[1, 2, 3], [4], [3, 1]]
    rows = SamplingRows(3, vocab, "cpu")
    for b in range(3):
        rows.add_row(b, _params(bad=seqs, temperature=0.0 if b else 1.0, allowed=None), b, (), [0], [])
    outputs: list[list[int]] = [[], [], []]
    sampler = Sampler()
    for step in range(40):
        logits = torch.randn(3, vocab, generator=rng(step))
        logits[:, [1, 2, 3, 4]] += 4.0  # tempt every row towards the bad words
        meta = rows.metadata(np.arange(3), np.array([len(o) for o in outputs]))
        tokens = sampler(logits, meta).sampled_token_ids
        rows.record_sampled(meta, tokens)
        for b, tok in enumerate(tokens.tolist()):
            outputs[b].append(tok)
    for out in outputs:
        assert 4 not in out
        for seq in seqs:
            assert all(out[i:i + len(seq)] != seq for i in range(len(out)))
        assert {1, 2, 3} & set(out)  # the words' tokens still appear, just never completed


# ---- the pools ------------------------------------------------------------------------------------
def test_recent_token_pool_keeps_the_last_width_tokens_per_slot():
    pool = RecentTokenPool(3, "cpu")
    a, b = pool.acquire([]), pool.acquire([5, 6, 7, 8])
    assert pool.tokens[a].tolist() == [-1, -1, -1] and pool.tokens[b].tolist() == [6, 7, 8]
    pool.record(torch.tensor([b, a]), torch.tensor([9, 1]))
    assert pool.tokens[a].tolist() == [-1, -1, 1] and pool.tokens[b].tolist() == [7, 8, 9]
    slots = [pool.acquire([i]) for i in range(5)]  # grows past the first capacity
    assert pool.capacity >= 7 and pool.tokens[b].tolist() == [7, 8, 9]
    assert [pool.tokens[s, -1].item() for s in slots] == list(range(5))
    pool.release(a)
    with pytest.raises(ValueError, match="not in use"):
        pool.release(a)


def test_allowed_token_pool_masks_ignore_ids_outside_the_vocabulary():
    pool = AllowedTokenPool(5, "cpu")
    s = pool.acquire([0, 4, 4, 9])
    assert pool.mask[s].tolist() == [True, False, False, False, True]
    pool.release(s)
    t = pool.acquire([2])  # a reused slot starts empty
    assert t == s and pool.mask[t].tolist() == [False, False, True, False, False]


def test_fused_kernel_applies_allowed_tokens_and_bad_words_like_the_torch_path():
    logits = torch.randn(4, 64, generator=rng(9))
    reqs = [make_request(seed=s, output=[5, 6], temperature=t) for s, t in
            ((0, 0.0), (1, 0.7), (2, 1.0), (3, 1.3))]
    for i, req in enumerate(reqs):
        req.sampling_params = _params(allowed=list(range(i, 64, 2)) if i % 2 else None,
                                      bad=[[6, int(logits[i].argmax())], [int(logits[i].argmax()) ^ 1]],
                                      temperature=req.sampling_params.temperature)
    got = sample(logits, reqs, Sampler(use_kernel=True)).sampled_token_ids
    want = sample(logits, reqs, Sampler(use_kernel=False)).sampled_token_ids
    assert torch.equal(got, want)
    assert all(int(t) != int(logits[i].argmax()) for i, t in enumerate(got))
