"""The grammar bitmask in the sampler: -inf exactly on the cleared bits of the constrained rows,
other rows untouched, greedy and random draws (torch and the Triton kernel) only allowed tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from peregrine.sample import Sampler, SamplingRows
from peregrine.sample.constraints import apply_token_bitmask
from peregrine.sampling_params import SamplingParams

_INF = float("-inf")


def _pack(allowed: np.ndarray) -> np.ndarray:
    """(G, V) bool -> (G, ceil(V / 32)) int32, bit t % 32 of word t // 32 (xgrammar's layout)."""
    g, v = allowed.shape
    words = -(-v // 32)
    padded = np.zeros((g, words * 32), np.uint64)
    padded[:, :v] = allowed
    weights = (np.uint64(1) << np.arange(32, dtype=np.uint64))
    packed = (padded.reshape(g, words, 32) * weights).sum(-1)  # (G, W) uint64 < 2**32
    return packed.astype(np.uint32).view(np.int32)


def test_pack_matches_xgrammar_layout():
    xgr = pytest.importorskip("xgrammar")
    allowed = np.zeros((1, 70), np.bool_)
    allowed[0, [0, 31, 32, 63, 69]] = True
    logits = torch.zeros(1, 70)
    xgr.apply_token_bitmask_inplace(logits, torch.from_numpy(_pack(allowed)))
    assert torch.equal(torch.isfinite(logits), torch.from_numpy(allowed))


@pytest.mark.parametrize("vocab", [5, 32, 33, 100])
def test_bitmask_sets_minus_inf_outside_the_allowed_tokens_of_listed_rows(vocab):
    gen = np.random.default_rng(vocab)
    logits = torch.randn(4, vocab)
    allowed = gen.random((2, vocab)) < 0.3
    allowed[:, 0] = True
    rows = torch.tensor([3, 1])
    x = logits.clone()
    apply_token_bitmask(x, rows, torch.from_numpy(_pack(allowed)))
    for g, r in enumerate([3, 1]):
        expected = logits[r].masked_fill(~torch.from_numpy(allowed[g]), _INF)
        assert torch.equal(x[r], expected)
    assert torch.equal(x[[0, 2]], logits[[0, 2]])


def _rows(params: list[SamplingParams], vocab: int) -> SamplingRows:
    rows = SamplingRows(len(params), vocab, "cpu")
    for i, p in enumerate(params):
        rows.add_row(i, p, seed=i, eos_token_ids=(), prompt_token_ids=[0], output_token_ids=[])
    return rows


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "triton"])
def test_draws_take_only_allowed_tokens_and_leave_free_rows_alone(use_kernel):
    vocab, n = 96, 8
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0, top_k=0 if i % 2 else 5)
              for i in range(n)]
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
    constrained = np.array([0, 2, 3, 5])
    gen = np.random.default_rng(1)
    allowed = gen.random((constrained.size, vocab)) < 0.1
    allowed[np.arange(constrained.size), gen.integers(0, vocab, constrained.size)] = True
    sampler = Sampler(use_kernel=use_kernel)
    rows = _rows(params, vocab)
    free = sampler(logits, rows.metadata(np.arange(n), np.zeros(n, np.int64))).sampled_token_ids
    for step in range(6):
        meta = rows.metadata(np.arange(n), np.full(n, step, np.int64))
        rows.add_grammar_masks(meta, constrained, _pack(allowed))
        out = sampler(logits, meta).sampled_token_ids
        for g, r in enumerate(constrained):
            assert allowed[g, int(out[r])], (step, r, int(out[r]))
            if params[r].temperature == 0.0:
                best = logits[r].masked_fill(~torch.from_numpy(allowed[g]), _INF).argmax()
                assert int(out[r]) == int(best)
        if step == 0:
            others = np.setdiff1d(np.arange(n), constrained)
            assert torch.equal(out[others], free[others])


def test_a_bitmask_of_the_wrong_shape_is_refused():
    rows = _rows([SamplingParams()], 64)
    meta = rows.metadata(np.arange(1), np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="grammar bitmask"):
        rows.add_grammar_masks(meta, np.array([0]), np.zeros((1, 3), np.int32))
    with pytest.raises(ValueError, match="grammar bitmask"):
        rows.add_grammar_masks(meta, np.array([0]), np.zeros((1, 2), np.int64))
