"""The persistent input batch: every request the worker holds, one preallocated row each.

A request's full data arrives once (NewRequestData); after that the worker keeps its tokens, block
table, progress and sampling settings here and appends the tokens it samples itself. Rows are
filled on arrival, emptied on finish or preemption, and `condense` moves the last rows into the
holes, so rows 0..num_reqs-1 are the live ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from peregrine.messages import NewRequestData
from peregrine.sample.metadata import SamplingRows
from peregrine.sampling_params import SamplingParams
from peregrine.spec_decode.config import speculation_allowed


@dataclass
class RequestState:
    """What the worker keeps per request besides its row's arrays."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...]


class InputBatch:
    """Per-row host arrays for up to max_num_reqs requests, and their sampling settings."""

    # Per-row arrays that move with a row on condense (token ids and block table separately).
    _ROW_ARRAYS = ("num_tokens", "num_known_tokens", "num_prompt_tokens", "num_computed_tokens",
                   "num_blocks", "prompt_logprobs", "pending_step", "pending_index", "generation",
                   "max_tokens", "can_speculate")

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 vocab_size: int, device: torch.device) -> None:
        n = max_num_reqs
        self.max_num_reqs = n
        self.max_model_len = max_model_len
        # NOTE: one spare column: the in-flight placeholder of a request at max_model_len stays in bounds.
        self.token_ids = np.zeros((n, max_model_len + 1), np.int32)  # (R, L+1) prompt, then outputs
        self.num_tokens = np.zeros(n, np.int64)  # (R,) prompt + outputs, in-flight ones included
        self.num_known_tokens = np.zeros(n, np.int64)  # (R,) leading tokens whose value is on the host
        self.num_prompt_tokens = np.zeros(n, np.int64)  # (R,)
        self.num_computed_tokens = np.zeros(n, np.int64)  # (R,) where this step's chunk starts
        self.block_table = np.zeros((n, max_blocks_per_req), np.int32)  # (R, max_blocks)
        self.num_blocks = np.zeros(n, np.int64)  # (R,)
        self.prompt_logprobs = np.full(n, -1, np.int64)  # (R,) top-k of prompt logprobs; -1: none
        # Async scheduling: a row whose last token is still on the device says which launched step
        # sampled it (-1: none) and its index in that step's sampled tensor.
        self.pending_step = np.full(n, -1, np.int64)  # (R,)
        self.pending_index = np.zeros(n, np.int64)  # (R,)
        self.generation = np.zeros(n, np.int64)  # (R,) tells a resumed request from its old self
        # Speculative decoding: output limit (caps drafts) and whether the row may verify drafts.
        self.max_tokens = np.zeros(n, np.int64)  # (R,)
        self.can_speculate = np.zeros(n, np.bool_)  # (R,)
        self._num_added = 0
        self.sampling = SamplingRows(n, vocab_size, device)
        self.states: list[RequestState | None] = [None] * n
        self.row_of: dict[str, int] = {}
        self._holes: set[int] = set()  # empty rows below self._end
        self._end = 0  # one past the highest occupied row

    @property
    def num_reqs(self) -> int:
        return len(self.row_of)

    def add_request(self, new: NewRequestData) -> int:
        """Put a new (or resumed) request in the lowest free row; returns the row."""
        if new.req_id in self.row_of:
            raise ValueError(f"request {new.req_id!r} is already in the batch")
        num_prompt, num_out = len(new.prompt_token_ids), len(new.output_token_ids)
        num_tokens = num_prompt + num_out
        if num_prompt == 0 or num_tokens > self.max_model_len:
            raise ValueError(f"request {new.req_id!r} has {num_tokens} tokens ({num_prompt} in the "
                             f"prompt); the limit is max_model_len={self.max_model_len}")
        if len(new.block_ids) > self.block_table.shape[1]:
            raise ValueError(f"request {new.req_id!r} has {len(new.block_ids)} blocks, more than "
                             f"{self.block_table.shape[1]} per request")
        if self._holes:
            row = min(self._holes)
            self._holes.remove(row)
        elif self._end < self.max_num_reqs:
            row = self._end
            self._end += 1
        else:
            # NOTE: finished and preempted ids arrive with the next step, even an empty one; a
            # full batch means some never reached the worker.
            raise RuntimeError(f"the input batch is full ({self.max_num_reqs} requests): were the "
                               f"ids of finished or preempted requests not sent to the worker?")
        self.token_ids[row, :num_prompt] = new.prompt_token_ids
        self.token_ids[row, num_prompt:num_tokens] = new.output_token_ids
        self.num_tokens[row] = self.num_known_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = num_prompt
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.block_table[row, :len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
        p = new.sampling_params
        self.prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.pending_step[row] = -1
        self.max_tokens[row] = (self.max_model_len if new.max_tokens is None
                                else min(new.max_tokens, self.max_model_len))
        self.can_speculate[row] = speculation_allowed(p)
        self._num_added += 1
        self.generation[row] = self._num_added
        self.sampling.add_row(row, p, new.seed, new.eos_token_ids, new.prompt_token_ids,
                              new.output_token_ids)
        self.states[row] = RequestState(new.req_id, list(new.prompt_token_ids), p, new.seed,
                                        tuple(new.eos_token_ids))
        self.row_of[new.req_id] = row
        return row

    def remove_request(self, req_id: str) -> bool:
        """Empty the request's row; False if the batch does not hold it."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return False
        self.states[row] = None
        self.sampling.remove_row(row)
        self.pending_step[row] = -1
        self._holes.add(row)
        return True

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        """Blocks allocated to the row's request since the last step."""
        have, now = int(self.num_blocks[row]), int(self.num_blocks[row]) + len(block_ids)
        if now > self.block_table.shape[1]:
            raise ValueError(f"request {self.states[row].req_id!r} would hold {now} blocks, more than "
                             f"{self.block_table.shape[1]} per request")
        self.block_table[row, have:now] = block_ids
        self.num_blocks[row] = now

    def condense(self) -> None:
        """Move the last occupied rows into the holes so that rows 0..num_reqs-1 are live."""
        while self._holes:
            last = self._end - 1
            if last in self._holes:  # trailing hole: just shrink
                self._holes.remove(last)
                self._end = last
                continue
            dst = min(self._holes)
            self._holes.remove(dst)
            self._move(last, dst)
            self._end = last

    def _move(self, src: int, dst: int) -> None:
        n, nb = int(self.num_tokens[src]), int(self.num_blocks[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for name in self._ROW_ARRAYS:
            arr = getattr(self, name)
            arr[dst] = arr[src]
        self.pending_step[src] = -1
        self.sampling.move_row(src, dst)
        state = self.states[src]
        self.states[dst], self.states[src] = state, None
        self.row_of[state.req_id] = dst

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        """Known tokens sampled elsewhere (by the last pipeline stage) for the row's request."""
        n = int(self.num_tokens[row])
        if n + len(token_ids) > self.max_model_len:
            raise ValueError(f"request {self.states[row].req_id!r} would hold "
                             f"{n + len(token_ids)} tokens, more than max_model_len="
                             f"{self.max_model_len}")
        self.token_ids[row, n:n + len(token_ids)] = token_ids
        self.num_tokens[row] = self.num_known_tokens[row] = n + len(token_ids)

    # ---- the tokens the worker sampled --------------------------------------------------------
    def append_placeholders(self, rows: np.ndarray, step_id: int) -> np.ndarray:
        """Reserve the next token of each row for a sample of launched step `step_id`; returns the
        positions (the values arrive with `fill_sampled`)."""
        pos = self.num_tokens[rows].copy()  # (S,)
        self.token_ids[rows, pos] = 0
        self.num_tokens[rows] = pos + 1
        self.pending_step[rows] = step_id
        self.pending_index[rows] = np.arange(rows.size)
        return pos

    def fill_sampled(self, req_ids: list[str], generations: np.ndarray, positions: np.ndarray,
                     token_ids: list[int], step_id: int) -> None:
        """Write the host values of launched step `step_id`'s samples into their rows (requests
        dropped since the launch are skipped: a resumed one holds its own tokens)."""
        rows = np.fromiter((self.row_of.get(r, -1) for r in req_ids), np.int64, len(req_ids))
        safe = np.maximum(rows, 0)
        ok = (rows >= 0) & (self.generation[safe] == generations)
        rows, pos = rows[ok], positions[ok]
        self.token_ids[rows, pos] = np.asarray(token_ids, np.int32)[ok]
        # NOTE: steps are collected in launch order, so the known tokens grow contiguously.
        self.num_known_tokens[rows] = np.maximum(self.num_known_tokens[rows], pos + 1)
        self.pending_step[rows[self.pending_step[rows] == step_id]] = -1

    def append_accepted(self, rows: np.ndarray, positions: np.ndarray, counts: np.ndarray,
                        token_ids: np.ndarray) -> None:
        """Verify steps: after the sampled token at `positions` (filled by fill_sampled), append
        counts[i] more tokens to rows[i], taken in order from the flat `token_ids`."""
        total = int(counts.sum())
        if total == 0:
            return
        first = np.zeros(counts.size, np.int64)  # (A,)
        np.cumsum(counts[:-1], out=first[1:])
        offsets = np.arange(total, dtype=np.int64) - np.repeat(first, counts)  # (sum counts,)
        self.token_ids[np.repeat(rows, counts), np.repeat(positions + 1, counts) + offsets] = \
            token_ids
        self.num_tokens[rows] += counts
        self.num_known_tokens[rows] = self.num_tokens[rows]

    def output_token_ids(self, req_id: str) -> list[int]:
        """The request's output tokens (an in-flight one reads 0 until its step is collected)."""
        row = self.row_of[req_id]
        return self.token_ids[row, self.num_prompt_tokens[row]:self.num_tokens[row]].tolist()

    def block_ids(self, req_id: str) -> list[int]:
        """The request's KV block ids, in order."""
        row = self.row_of[req_id]
        return self.block_table[row, :self.num_blocks[row]].tolist()
