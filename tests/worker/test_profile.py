"""The KV-sizing profile step: a worst-case forward the step buffers can hold."""
from __future__ import annotations

from peregrine.worker.profile import profile_run
from tests.worker.worker_helpers import make_worker


def test_a_budget_above_max_num_seqs_full_sequences_is_profiled_within_the_block_table() -> None:
    # spec_bench's self-draft case at batch 1: one sequence of at most max_model_len tokens
    # under a token budget eight times longer, with k + 1 sampled rows per verify step.
    w = make_worker(max_model_len=64, max_num_seqs=1, max_num_batched_tokens=512,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    sc, r = w.config.scheduler, w.model_runner
    assert sc.max_num_batched_tokens > sc.max_num_seqs * sc.max_model_len
    profile_run(w.model, r.buffers, w.config.model, sc.max_num_batched_tokens, sc.max_num_seqs,
                w.config.cache.block_size, w._max_sampled_rows())
    # The profile filled the one row the scheduler could: max_model_len tokens, its whole table.
    assert int(r.buffers.seq_lens_np[0]) == sc.max_model_len
    assert int(r.buffers.block_table_np[0, -1]) == r.max_blocks_per_req - 1
