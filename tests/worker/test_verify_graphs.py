"""Verify graphs' sizes and limits (their steps through the engine: tests/spec_decode)."""
from __future__ import annotations

import pytest
import torch
from worker_helpers import make_worker

from peregrine.worker.verify_graphs import VerifyGraphs, verify_graph_batch


def test_verify_graph_batch_is_capped_by_disable_by_batch_size_and_the_token_budget() -> None:
    assert verify_graph_batch(256, 8192, 4, 32) == 32
    assert verify_graph_batch(256, 8192, 4, None) == 256
    assert verify_graph_batch(8, 8192, 4, 32) == 8
    assert verify_graph_batch(256, 64, 4, 32) == 12  # 12 x 5 tokens fit a 64-token budget


def test_sizes_and_what_fits() -> None:
    w = make_worker(max_num_seqs=8, max_num_batched_tokens=64)
    r = w.model_runner
    g = VerifyGraphs(w.model, r.buffers, r.kv_caches, 8, 4, 64, capture=False)
    assert g.sizes == [1, 2, 4, 8] and g.query_len == 5
    assert g.padded(3) == 4 and g.num_tokens(4) == 20
    assert g.can_run(3, 15) and not g.can_run(3, 16) and not g.can_run(9, 9)
    with torch.inference_mode():
        assert tuple(g.replay(2).shape) == (10, w.config.model.vocab_size)


def test_a_batch_past_the_step_buffers_is_refused() -> None:
    w = make_worker(max_num_seqs=8, max_num_batched_tokens=32)
    r = w.model_runner
    with pytest.raises(ValueError, match="exceed the step buffers"):
        VerifyGraphs(w.model, r.buffers, r.kv_caches, 8, 4, 64, capture=False)
    with pytest.raises(ValueError, match="k >= 1"):
        VerifyGraphs(w.model, r.buffers, r.kv_caches, 4, 0, 64, capture=False)


def test_graph_logits_of_leading_rows_are_a_view_and_others_are_gathered() -> None:
    from types import SimpleNamespace

    import numpy as np
    w = make_worker(max_num_seqs=8, max_num_batched_tokens=64)
    r = w.model_runner
    all_logits = torch.randn(10, 7)  # a padded verify graph's rows
    lead = r._logits(SimpleNamespace(logits_idx=np.arange(4)), None, all_logits)
    assert lead.data_ptr() == all_logits.data_ptr() and torch.equal(lead, all_logits[:4])
    assert torch.equal(r._logits(SimpleNamespace(logits_idx=np.arange(10)), None, all_logits),
                       all_logits)
    idx = np.array([0, 5, 6])
    assert torch.equal(r._logits(SimpleNamespace(logits_idx=idx), None, all_logits),
                       all_logits[torch.from_numpy(idx)])
