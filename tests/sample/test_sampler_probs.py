"""Sampler(return_probs=True): the distribution each row was drawn from, on both sampler paths."""
from __future__ import annotations

import pytest
import torch
from sample_helpers import make_request, rng

from peregrine.sample import Sampler, build_sampling_metadata

_PARAMS = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.2, top_k=5),
           dict(temperature=0.7, top_p=0.6), dict(temperature=1.0, min_p=0.2),
           dict(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3),
           dict(temperature=0.0, presence_penalty=1.0), dict(temperature=1.0, logit_bias={3: 4.0})]


def _batch() -> tuple[torch.Tensor, list]:
    reqs = [make_request(seed=i, prompt=[1, 2, 3], output=[4, 4], **p) for i, p in enumerate(_PARAMS)]
    return torch.randn(len(reqs), 300, generator=rng()) * 3, reqs  # (B, V)


def test_probs_are_the_filtered_distribution_and_cover_the_sampled_token() -> None:
    logits, reqs = _batch()
    meta = build_sampling_metadata(reqs, 300, "cpu")
    out = Sampler(use_kernel=False)(logits, meta, return_probs=True)
    probs = out.probs  # (B, V)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(reqs)))
    assert (probs.gather(-1, out.sampled_token_ids.unsqueeze(-1)) > 0).all()
    for i in (0, 6):  # greedy rows: one-hot on the argmax of the penalised logits
        assert probs[i].max() == 1.0 and probs[i].count_nonzero() == 1
    assert probs[2].count_nonzero() == 5  # top-k 5
    # Plain temperature: softmax(logits / T).
    torch.testing.assert_close(probs[1], torch.softmax(logits[1] / 0.8, -1))
    # min-p: kept tokens have at least 0.2 of the top probability.
    kept = probs[4] > 0
    p = torch.softmax(logits[4], -1)
    assert torch.equal(kept, p >= 0.2 * p.max())
    assert Sampler(use_kernel=False)(logits, meta).probs is None  # opt-in


def test_fused_and_torch_paths_return_the_same_probs() -> None:
    logits, reqs = _batch()
    meta = build_sampling_metadata(reqs, 300, "cpu")
    ref = Sampler(use_kernel=False)(logits, meta, return_probs=True)
    fused = Sampler(use_kernel=True)(logits, meta, return_probs=True)
    assert torch.equal(fused.sampled_token_ids, ref.sampled_token_ids)
    torch.testing.assert_close(fused.probs, ref.probs, rtol=0, atol=0)
    compact = [make_request(seed=i, temperature=0.9, top_k=7) for i in range(3)]
    meta = build_sampling_metadata(compact, 300, "cpu")
    ref = Sampler(use_kernel=False)(logits[:3], meta, return_probs=True)
    fused = Sampler(use_kernel=True)(logits[:3], meta, return_probs=True)
    torch.testing.assert_close(fused.probs, ref.probs, rtol=0, atol=0)
    assert (ref.probs.count_nonzero(-1) == 7).all()


@pytest.mark.parametrize("use_kernel", [False, True])
def test_bf16_logits_give_float32_probs(use_kernel: bool) -> None:
    logits, reqs = _batch()
    meta = build_sampling_metadata(reqs, 300, "cpu")
    out = Sampler(use_kernel=use_kernel)(logits.bfloat16(), meta, return_probs=True)
    assert out.probs.dtype == torch.float32
    assert (out.probs.gather(-1, out.sampled_token_ids.unsqueeze(-1)) > 0).all()
