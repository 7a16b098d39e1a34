"""One step's flat inputs, computed with numpy over the persistent batch's rows.

The step runs its requests decodes first (the attention backend splits the batch there); `order`
maps each execution row back to its place in the scheduler's order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from peregrine.messages import SchedulerOutput
from peregrine.worker.input_batch import InputBatch
from peregrine.worker.step_buffers import StepBuffers


@dataclass
class StepPlan:
    """Where each request sits in the step, which rows sample, and which logits are needed."""

    req_ids: list[str]  # the scheduler's order
    order: np.ndarray  # (B,) scheduler index of each execution row
    rows: np.ndarray  # (B,) batch row of each execution row
    num_tokens: int  # T
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    width: int  # block-table columns in use
    # Inputs sampled by a launched step that is not collected yet: flat token index, that step's
    # id and the index in its sampled tensor.
    pending_dst: np.ndarray  # (N,)
    pending_step: np.ndarray  # (N,)
    pending_src: np.ndarray  # (N,)
    sample_idx: np.ndarray  # (S,) execution rows that sample a token
    sample_steps: np.ndarray  # (S,) output tokens before the one sampled now
    # Speculative verify rows sample at each of their 1 + d positions (one logits row each).
    sample_counts: np.ndarray  # (S,) logits rows of each sampling row (1 + its drafts)
    flat_steps: np.ndarray  # (S',) output tokens before each logits row's token
    # (S',) the draft each logits row's token must equal to be accepted; -1 at a row's last
    # position. None when the step verifies no drafts.
    draft_tokens: np.ndarray | None
    prompt_idx: np.ndarray  # (P,) execution rows with prompt logprobs in this chunk
    prompt_counts: np.ndarray  # (P,) how many prompt positions each
    prompt_targets: np.ndarray  # (sum counts,) the next prompt token of each position
    logits_idx: np.ndarray  # (S + sum counts,) flat token indices: samples, then prompt positions

    @property
    def num_seqs(self) -> int:
        return int(self.rows.size)

    @property
    def num_sampled_rows(self) -> int:
        """S': logits rows that are sampled (S without drafts)."""
        return int(self.flat_steps.size)


def plan_step(batch: InputBatch, sched: SchedulerOutput, buf: StepBuffers,
              block_size: int) -> StepPlan:
    """Fill the host step buffers for `sched` and describe the step."""
    req_ids = list(sched.num_scheduled_tokens)
    b = len(req_ids)
    n_sched = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, b)  # (B,)
    try:
        rows_sched = np.fromiter(map(batch.row_of.__getitem__, req_ids), np.int64, b)  # (B,)
    except KeyError as e:
        raise ValueError(f"scheduled request {e.args[0]!r} is unknown to the worker") from None
    # NOTE: decodes (query length 1) go first: the attention backend splits the batch there.
    order = np.argsort(n_sched != 1, kind="stable")  # (B,)
    rows, q_lens = rows_sched[order], n_sched[order]  # (B,), (B,)
    starts = batch.num_computed_tokens[rows]  # (B,)
    seq_lens = starts + q_lens  # (B,)
    num_tokens = batch.num_tokens[rows]  # (B,)
    spec = sched.scheduled_spec_decode_tokens
    num_draft = np.zeros(b, np.int64)  # (B,)
    if spec:
        num_draft = _write_drafts(batch, spec, req_ids)[order]
        verify = num_draft > 0
        if (starts[verify] != num_tokens[verify] - 1).any():
            bad = int(np.flatnonzero(verify & (starts != num_tokens - 1))[0])
            raise ValueError(f"request {req_ids[order[bad]]!r}: drafts are scheduled but its "
                             f"last token is not the first one computed")
    ends = num_tokens + num_draft  # (B,) the last input position + 1 it may reach
    if (q_lens <= 0).any() or (seq_lens > ends).any():
        bad = int(np.flatnonzero((q_lens <= 0) | (seq_lens > ends))[0])
        raise ValueError(f"request {req_ids[order[bad]]!r}: {int(q_lens[bad])} tokens scheduled "
                         f"from {int(starts[bad])}, but it has {int(ends[bad])}")
    qsl = np.zeros(b + 1, np.int64)  # (B + 1,)
    np.cumsum(q_lens, out=qsl[1:])
    t = int(qsl[-1])
    num_decodes = int(np.searchsorted(q_lens != 1, True))
    positions = np.arange(t, dtype=np.int64) - np.repeat(qsl[:-1] - starts, q_lens)  # (T,)
    tok_rows = np.repeat(rows, q_lens)  # (T,)
    block_idx = positions // block_size  # (T,)
    if (block_idx >= batch.num_blocks[tok_rows]).any():
        bad = tok_rows[np.flatnonzero(block_idx >= batch.num_blocks[tok_rows])[0]]
        raise ValueError(f"request {batch.states[bad].req_id!r}: its tokens need more KV blocks "
                         f"than the {int(batch.num_blocks[bad])} it was given")
    buf.input_ids_np[:t] = batch.token_ids[tok_rows, positions]
    blocks = batch.block_table[tok_rows, block_idx]  # (T,)
    buf.positions_np[:t] = positions
    buf.slot_mapping_np[:t] = blocks.astype(np.int64) * block_size + positions % block_size
    width = int(batch.num_blocks[rows].max())
    buf.block_table_np[:b, :width] = batch.block_table[rows, :width]
    buf.seq_lens_np[:b] = seq_lens
    buf.query_start_loc_np[:b + 1] = qsl

    # Inputs whose value is still on the device: only a request's last token can be one.
    known = batch.num_known_tokens[rows]  # (B,)
    waiting = np.flatnonzero(np.minimum(seq_lens, num_tokens) > known)  # (N,)
    last = num_tokens[waiting] - 1  # (N,)
    pending_step = batch.pending_step[rows[waiting]]  # (N,)
    if (known[waiting] != last).any() or (pending_step < 0).any():
        raise RuntimeError("a step's input token is neither on the host nor in flight")
    pending_dst = qsl[waiting] + last - starts[waiting]  # (N,)
    pending_src = batch.pending_index[rows[waiting]]  # (N,)

    # A request samples once its chunk reaches its last token (an in-flight one included); a
    # verify row samples after its last token and after each draft.
    sample_idx = np.flatnonzero(seq_lens >= ends)  # (S,)
    sample_steps = num_tokens[sample_idx] - batch.num_prompt_tokens[rows[sample_idx]]  # (S,)
    counts_s = 1 + num_draft[sample_idx]  # (S,)
    sample_tok = qsl[sample_idx + 1] - 1  # (S,) flat index of each row's last position
    flat_steps, draft_tokens = sample_steps, None
    if spec:
        first_s = np.zeros(sample_idx.size, np.int64)  # (S,)
        np.cumsum(counts_s[:-1], out=first_s[1:])
        j = np.arange(int(counts_s.sum()), dtype=np.int64) - np.repeat(first_s, counts_s)  # (S',)
        last_rep = np.repeat(counts_s - 1, counts_s)  # (S',)
        sample_tok = np.repeat(sample_tok - counts_s + 1, counts_s) + j  # (S',)
        flat_steps = np.repeat(sample_steps, counts_s) + j
        # NOTE: the token sampled at a position is checked against the next input: its draft.
        nxt = np.minimum(sample_tok + 1, t - 1)
        draft_tokens = np.where(j < last_rep, buf.input_ids_np[nxt], -1).astype(np.int64)

    # Prompt logprobs: position p scores prompt token p + 1.
    num_prompt = batch.num_prompt_tokens[rows]  # (B,)
    prompt_idx = np.flatnonzero((batch.prompt_logprobs[rows] >= 0) & (starts < num_prompt - 1))
    counts = np.minimum(seq_lens[prompt_idx], num_prompt[prompt_idx] - 1) - starts[prompt_idx]
    first = np.zeros(prompt_idx.size, np.int64)  # (P,) offset of each row's first position
    np.cumsum(counts[:-1], out=first[1:])
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)
    prompt_tok = np.repeat(qsl[prompt_idx], counts) + offsets
    prompt_pos = np.repeat(starts[prompt_idx], counts) + offsets
    targets = batch.token_ids[np.repeat(rows[prompt_idx], counts), prompt_pos + 1].astype(np.int64)
    logits_idx = np.concatenate([sample_tok, prompt_tok])

    return StepPlan(req_ids, order, rows, t, num_decodes, int(q_lens.max()), int(seq_lens.max()),
                    width, pending_dst, pending_step, pending_src, sample_idx, sample_steps,
                    counts_s, flat_steps, draft_tokens, prompt_idx, counts, targets, logits_idx)


def _write_drafts(batch: InputBatch, spec: dict[str, list[int]], req_ids: list[str]) -> np.ndarray:
    """Put each verify request's drafts after its last token; (B,) drafts per scheduled request."""
    width = batch.token_ids.shape[1]
    for rid, drafts in spec.items():
        row = batch.row_of.get(rid)
        if row is None:
            raise ValueError(f"drafts are scheduled for request {rid!r}, unknown to the worker")
        n = int(batch.num_tokens[row])
        if n + len(drafts) > width - 1:
            raise ValueError(f"request {rid!r}: {len(drafts)} drafts after {n} tokens pass "
                             f"max_model_len={width - 1}")
        batch.token_ids[row, n:n + len(drafts)] = drafts
    return np.fromiter((len(spec.get(r, ())) for r in req_ids), np.int64, len(req_ids))
