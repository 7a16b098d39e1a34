"""The persistent input batch and the step plan: rows, condense, in-flight tokens, numpy inputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from worker_helpers import Step, new_req

from peregrine.sample import Sampler
from peregrine.worker.input_batch import InputBatch
from peregrine.worker.step_buffers import StepBuffers
from peregrine.worker.step_plan import plan_step

BS = 4


def _batch(max_reqs: int = 4) -> InputBatch:
    return InputBatch(max_reqs, 32, 8, 100, torch.device("cpu"))


def _buffers() -> StepBuffers:
    return StepBuffers(64, 4, 8, torch.device("cpu"))


def test_rows_fill_holes_and_condense_moves_the_last_rows_down() -> None:
    batch = _batch()
    for i, rid in enumerate("abcd"):
        batch.add_request(new_req(rid, [10 + i] * (i + 1), [i], repetition_penalty=1.0 + i))
    batch.remove_request("a")
    batch.remove_request("c")
    assert batch.add_request(new_req("e", [50, 51], [7])) == 0  # the lowest hole
    batch.condense()
    assert batch.row_of == {"e": 0, "b": 1, "d": 2}
    assert batch.token_ids[2, :4].tolist() == [13] * 4 and batch.num_tokens[:3].tolist() == [2, 2, 4]
    assert batch.block_ids("d") == [3]
    # Sampling settings (and the penalty slot) moved with the row.
    assert batch.sampling.repetition[2] == pytest.approx(4.0) and batch.sampling.penalty_slot[2] >= 0
    assert batch.sampling.penalty_slot[3] == -1 and batch.sampling.penalties.num_used == 2


def test_constraint_slots_move_with_the_row_and_are_freed_with_it() -> None:
    batch = _batch()
    batch.add_request(new_req("a", [1], [0], allowed_token_ids=[3]))
    batch.add_request(new_req("b", [1], [1], output=[4, 5], allowed_token_ids=[2, 6, 9],
                              bad_words=["w"], _bad_words_token_ids=[[5, 6]]))
    rows = batch.sampling
    slot_allowed, slot_recent = rows.allowed_slot[1], rows.recent_slot[1]
    batch.remove_request("a")
    batch.condense()
    assert batch.row_of == {"b": 0}
    assert (rows.allowed_slot[0], rows.recent_slot[0]) == (slot_allowed, slot_recent)
    assert rows.allowed_slot[1] == rows.recent_slot[1] == -1 and rows.bad_words[1] is None
    assert rows.allowed.mask[slot_allowed].nonzero().flatten().tolist() == [2, 6, 9]
    assert rows.recent.tokens[slot_recent, -2:].tolist() == [4, 5]
    # The moved row still bans 6 after its 5.
    logits = torch.zeros(1, 100)
    out = Sampler.apply_penalties(logits, rows.metadata(np.array([0]), np.array([2])))
    assert torch.isinf(out[0]).sum() == 98 and out[0, 6] == float("-inf")
    assert out[0, 2] == out[0, 9] == 0.0
    batch.remove_request("b")
    assert len(rows.allowed._free) == rows.allowed.capacity
    assert len(rows.recent._free) == rows.recent.capacity


def test_a_full_batch_and_bad_requests_raise() -> None:
    batch = _batch(max_reqs=1)
    batch.add_request(new_req("a", [1, 2], [0]))
    with pytest.raises(ValueError, match="already"):
        batch.add_request(new_req("a", [1, 2], [0]))
    with pytest.raises(RuntimeError, match="full"):
        batch.add_request(new_req("b", [1, 2], [0]))
    with pytest.raises(ValueError, match="max_model_len"):
        _batch().add_request(new_req("c", list(range(40)), [0]))


def test_sampled_tokens_fill_only_the_request_that_sampled_them() -> None:
    batch = _batch()
    batch.add_request(new_req("a", [1, 2, 3], [0]))
    row = batch.row_of["a"]
    gen = batch.generation[[row]].copy()
    pos = batch.append_placeholders(np.array([row]), step_id=5)
    assert pos.tolist() == [3] and batch.num_tokens[row] == 4 and batch.num_known_tokens[row] == 3
    # Dropped and resumed before the step was collected: the old sample is not written.
    batch.remove_request("a")
    batch.add_request(new_req("a", [1, 2, 3], [0], output=[]))
    batch.fill_sampled(["a"], gen, pos, [42], step_id=5)
    assert batch.output_token_ids("a") == []
    gen = batch.generation[[row]].copy()
    pos = batch.append_placeholders(np.array([row]), step_id=6)
    batch.fill_sampled(["a"], gen, pos, [42], step_id=6)
    assert batch.output_token_ids("a") == [42] and batch.pending_step[row] == -1


def test_plan_puts_decodes_first_and_knows_who_samples() -> None:
    batch, buf = _batch(), _buffers()
    batch.add_request(new_req("p", list(range(20, 30)), [0, 1, 2], prompt_logprobs=2))  # 10 tokens
    batch.add_request(new_req("d", [5, 6, 7], [3, 6], output=[8, 9]))
    step = Step({"p": 6, "d": 1}, computed={"p": 0, "d": 4})
    # "d" has 5 tokens and 4 computed: a decode of its last token; "p" a 6-token chunk.
    batch.num_computed_tokens[batch.row_of["d"]] = 4
    plan = plan_step(batch, step.output(), buf, BS)
    assert plan.order.tolist() == [1, 0] and plan.num_decodes == 1 and plan.num_tokens == 7
    assert buf.input_ids_np[:7].tolist() == [9, 20, 21, 22, 23, 24, 25]
    assert buf.positions_np[:7].tolist() == [4, 0, 1, 2, 3, 4, 5]
    assert buf.slot_mapping_np[:7].tolist() == [6 * BS + 0, 0, 1, 2, 3, 4, 5]
    assert buf.query_start_loc_np[:3].tolist() == [0, 1, 7] and buf.seq_lens_np[:2].tolist() == [5, 6]
    assert plan.sample_idx.tolist() == [0] and plan.sample_steps.tolist() == [2]
    # Prompt logprobs of positions 0..5 (targets: the next prompt token), after the sample row.
    assert plan.prompt_idx.tolist() == [1] and plan.prompt_counts.tolist() == [6]
    assert plan.prompt_targets.tolist() == list(range(21, 27))
    assert plan.logits_idx.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert plan.pending_dst.size == 0


def test_plan_reads_an_in_flight_input_from_the_launched_step() -> None:
    batch, buf = _batch(), _buffers()
    batch.add_request(new_req("x", [1], [0]))
    batch.add_request(new_req("y", [2, 3], [1]))
    rows = np.array([batch.row_of["y"], batch.row_of["x"]])
    batch.append_placeholders(rows, step_id=3)  # sampled by step 3, not collected
    batch.num_computed_tokens[rows] = [2, 1]
    plan = plan_step(batch, Step({"x": 1, "y": 1}, computed={"x": 1, "y": 2}).output(), buf, BS)
    assert plan.pending_dst.tolist() == [0, 1] and plan.pending_step.tolist() == [3, 3]
    assert plan.pending_src.tolist() == [1, 0]  # x was row 1 of step 3's samples
    assert plan.sample_steps.tolist() == [1, 1]


def test_plan_rejects_more_tokens_than_the_request_has_or_its_blocks_hold() -> None:
    batch = _batch()
    batch.add_request(new_req("x", [1, 2, 3], [0]))
    with pytest.raises(ValueError, match="scheduled"):
        plan_step(batch, Step({"x": 4}, computed={"x": 0}).output(), _buffers(), BS)
    batch.add_request(new_req("y", [1, 2, 3, 4, 5], [1]))
    with pytest.raises(ValueError, match="blocks"):
        plan_step(batch, Step({"y": 5}, computed={"y": 0}).output(), _buffers(), BS)
