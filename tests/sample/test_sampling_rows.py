"""SamplingRows: step metadata cut from persistent rows, uploaded once per batch composition, and
penalty counts kept on the device across steps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from peregrine.sample import Sampler, SamplingRows
from peregrine.sampling_params import SamplingParams


def _rows(*params: dict, vocab: int = 8, outputs: list[list[int]] | None = None) -> SamplingRows:
    rows = SamplingRows(len(params) + 2, vocab, "cpu")
    for i, p in enumerate(params):
        rows.add_row(i, SamplingParams(**p), seed=i, eos_token_ids=(7,), prompt_token_ids=[1, 2],
                     output_token_ids=(outputs or [[]] * len(params))[i])
    return rows


def test_same_composition_reuses_the_device_rows_and_moves_only_steps() -> None:
    rows = _rows(dict(temperature=0.5), dict(temperature=0.0))
    a = rows.metadata(np.array([1, 0]), np.array([3, 4]))
    b = rows.metadata(np.array([1, 0]), np.array([4, 5]))
    assert a.temperature is b.temperature and a.seeds is b.seeds  # not uploaded again
    assert b.steps.tolist() == [4, 5] and a.steps.tolist() == [3, 4]
    assert b.temperature.tolist() == pytest.approx([1.0, 0.5]) and b.greedy_mask.tolist() == [True, False]
    c = rows.metadata(np.array([0, 1]), np.array([4, 5]))  # another order: another composition
    assert c.temperature.tolist() == pytest.approx([0.5, 1.0]) and c.seeds.tolist() == [0, 1]
    rows.add_row(2, SamplingParams(), seed=9, eos_token_ids=(), prompt_token_ids=[1],
                 output_token_ids=[])
    d = rows.metadata(np.array([0, 1]), np.array([4, 5]))  # same rows, but the batch changed
    assert d.temperature is not c.temperature


def test_alternating_compositions_are_each_uploaded_once_per_batch() -> None:
    from peregrine.sample.metadata import MAX_CACHED_COMPOSITIONS
    rows = _rows(dict(temperature=0.5), dict(temperature=0.0))
    plain, verify = np.array([0, 1]), np.array([0, 0, 0, 1, 1])  # a verify step repeats rows
    a = rows.metadata(plain, np.array([3, 4]))
    v = rows.metadata(verify, np.arange(5))
    b = rows.metadata(plain, np.array([4, 5]))
    w = rows.metadata(verify, np.arange(5) + 1)
    assert b.temperature is a.temperature and w.temperature is v.temperature
    assert w.temperature.tolist() == pytest.approx([0.5, 0.5, 0.5, 1.0, 1.0])
    assert w.greedy_mask.tolist() == [False] * 3 + [True] * 2 and w.steps.tolist() == [1, 2, 3, 4, 5]
    for n in range(2, 2 + MAX_CACHED_COMPOSITIONS):  # the plain one is used least recently
        rows.metadata(np.zeros(n, np.int64), np.arange(n))
    assert rows.metadata(plain, np.array([5, 6])).temperature is not a.temperature
    rows.remove_row(1)
    c = rows.metadata(np.array([0]), np.array([7]))  # the batch changed: built afresh
    assert c.temperature.tolist() == pytest.approx([0.5])


def test_penalty_counts_follow_the_sampled_tokens_on_the_device() -> None:
    rows = _rows(dict(temperature=0.0), dict(temperature=0.0, presence_penalty=2.0),
                 outputs=[[], [3]])
    meta = rows.metadata(np.array([0, 1]), np.array([0, 1]))
    assert meta.penalty_rows.tolist() == [1]
    slot = int(meta.penalty_slots[0])
    assert rows.penalties.counts[slot].tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
    rows.record_sampled(meta, torch.tensor([5, 6]))  # row 1 sampled 6; row 0 has no penalties
    rows.record_sampled(meta, torch.tensor([5, 6]))
    assert rows.penalties.counts[slot].tolist() == [0, 0, 0, 1, 0, 0, 2, 0]
    logits = torch.zeros(2, 8)
    out = Sampler.apply_penalties(logits, rows.metadata(np.array([0, 1]), np.array([0, 3])))
    assert out[0].tolist() == [0.0] * 8
    assert out[1].tolist() == [0.0, 0.0, 0.0, -2.0, 0.0, 0.0, -2.0, 0.0]


def test_min_tokens_bans_follow_each_steps_index() -> None:
    rows = _rows(dict(min_tokens=2, stop_token_ids=[4]), dict(min_tokens=1, ignore_eos=True))
    meta = rows.metadata(np.array([0, 1]), np.array([1, 0]))
    assert sorted(zip(meta.banned_rows.tolist(), meta.banned_tokens.tolist())) == [(0, 4), (0, 7)]
    meta = rows.metadata(np.array([0, 1]), np.array([2, 0]))
    assert not meta.any_min_tokens and meta.banned_rows is None  # row 1 bans nothing (ignore_eos)


def test_logit_bias_rows_follow_the_step_order() -> None:
    rows = _rows(dict(logit_bias={2: 1.5}), dict(), dict(logit_bias={5: -3.0, 1: 2.0}))
    meta = rows.metadata(np.array([2, 1, 0]), np.zeros(3, np.int64))
    got = sorted(zip(meta.bias_rows.tolist(), meta.bias_tokens.tolist(), meta.bias_values.tolist()))
    assert got == [(0, 1, 2.0), (0, 5, -3.0), (2, 2, 1.5)]


def test_moved_rows_keep_their_settings_and_removed_rows_free_their_slot() -> None:
    rows = _rows(dict(repetition_penalty=1.5), dict(repetition_penalty=2.0, logit_bias={3: 1.0}))
    rows.move_row(1, 3)
    meta = rows.metadata(np.array([3]), np.array([0]))
    assert meta.repetition_penalties.tolist() == [2.0] and meta.bias_tokens.tolist() == [3]
    assert rows.penalty_slot[1] == -1 and rows.penalties.num_used == 2
    rows.remove_row(3)
    assert rows.penalties.num_used == 1


def test_the_penalty_pool_grows_and_keeps_what_it_holds() -> None:
    rows = SamplingRows(9, 8, "cpu")
    for i in range(9):
        rows.add_row(i, SamplingParams(frequency_penalty=0.5), seed=i, eos_token_ids=(),
                     prompt_token_ids=[i % 8], output_token_ids=[i % 8, i % 8])
    assert rows.penalties.capacity >= 9
    for i in range(9):
        slot = int(rows.penalty_slot[i])
        assert rows.penalties.counts[slot, i % 8] == 2 and rows.penalties.prompt_mask[slot].sum() == 1


def test_no_rows_or_mismatched_steps_raise() -> None:
    rows = _rows(dict())
    with pytest.raises(ValueError, match="at least one"):
        rows.metadata(np.array([], np.int64), np.array([], np.int64))
    with pytest.raises(ValueError, match="steps"):
        rows.metadata(np.array([0]), np.array([0, 1]))
