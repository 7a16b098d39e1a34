"""Per-request grammar matchers in the engine core, and each step's allowed-token bitmask.

The matcher of a request advances over exactly the output tokens the scheduler kept, so it always
describes `Request.output_token_ids`: a preempted request keeps its matcher (the recompute replays
its tokens through the model, not through the grammar). A step that samples a constrained row is
never pipelined (engine/core.py): its mask needs the token of the step before it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from peregrine.structured_output.compiler import CompiledStructure


@dataclass
class _State:
    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0  # output tokens fed to the matcher
    error: str | None = None  # set once a token is rejected


class StructuredOutputManager:
    """Matchers by request id; builds the step's (G, ceil(V / 32)) int32 bitmask."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self._states: dict[str, _State] = {}
        self._bitmask = np.zeros((0, self.words), np.int32)  # grows to the widest step

    def __bool__(self) -> bool:
        return bool(self._states)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._states

    def add(self, req_id: str, compiled: CompiledStructure) -> None:
        """Start a matcher for a new request."""
        self._states[req_id] = _State(compiled.new_matcher())

    def remove(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self._states.pop(rid, None)

    def bitmask(self, requests: Mapping[str, Any], num_scheduled: Mapping[str, int]
                ) -> tuple[list[str], np.ndarray] | None:
        """(ids, (G, W) int32 bitmask) of the constrained requests that sample this step;
        None when there are none. Bit t of row g allows token t.

        requests: the live requests by id; num_scheduled: the step's tokens per request id.
        """
        states = self._states
        ids: list[str] = []
        # NOTE: a loop over the constrained requests only, not over the batch.
        for rid in states:
            n = num_scheduled.get(rid)
            if n is None:
                continue
            req = requests[rid]
            # NOTE: a request samples when its chunk reaches its last token (as in mark_in_flight).
            if req.num_computed_tokens + n >= req.num_tokens + req.num_output_placeholders:
                ids.append(rid)
        if not ids:
            return None
        if self._bitmask.shape[0] < len(ids):
            self._bitmask = np.zeros((max(len(ids), 2 * self._bitmask.shape[0]), self.words), np.int32)
        for g, rid in enumerate(ids):
            state = states[rid]
            if state.matcher.is_terminated() or state.error is not None:
                self._bitmask[g] = -1  # finishing this step anyway: leave the row unconstrained
            else:
                state.matcher.fill_next_token_bitmask(self._bitmask, g)
        return ids, self._bitmask[:len(ids)].copy()

    def accept(self, requests: Mapping[str, Any]) -> tuple[list[str], list[tuple[str, str]]]:
        """Feed each live constrained request (`requests`: the live requests by id) its new
        output tokens. Returns (ids whose grammar has terminated, (id, error) of those whose token
        the grammar rejected)."""
        terminated: list[str] = []
        rejected: list[tuple[str, str]] = []
        for rid, state in self._states.items():
            req = requests.get(rid)
            if req is None or state.error is not None:
                continue  # finished (its matcher goes with the step's finished list) or failed
            for tok in req.output_token_ids[state.num_accepted:]:
                if state.matcher.is_terminated():
                    break  # tokens after the end (ignore_eos): the request finishes now
                if not state.matcher.accept_token(tok):
                    state.error = (f"token {tok} at output position {state.num_accepted} is not "
                                   f"allowed by the request's structured_outputs grammar")
                    rejected.append((rid, state.error))
                    break
                state.num_accepted += 1
            if state.error is None and state.matcher.is_terminated():
                terminated.append(rid)
        return terminated, rejected
