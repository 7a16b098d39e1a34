"""Device-side state of token constraints: allowed-token masks and each row's recent output tokens.

`allowed_token_ids` keeps a (V,) mask per request, built once when it arrives. `bad_words` needs
the request's last few output tokens on the device: with async scheduling the host learns a step's
tokens one step late, so the sampled tensor is shifted into a per-request window of the last
`width` output tokens right after sampling, and the next step's bans are matched against it there.
Both pools hand out slots on demand and grow, as `PenaltyPool` does.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from peregrine.transfer import to_device

_NEG_INF = float("-inf")


class AllowedTokenPool:
    """(N, V) bool: the tokens each slot's request may sample."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)  # (N, V)
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return int(self.mask.shape[0])

    def acquire(self, token_ids: Sequence[int]) -> int:
        """A slot whose mask holds exactly `token_ids` (ids outside the vocabulary are ignored)."""
        if not self._free:
            self._grow(max(4, 2 * self.capacity))
        slot = self._free.pop()
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)  # (A,)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        self.mask[slot].zero_()
        if ids.size:
            self.mask[slot].index_fill_(0, to_device(ids, self.device), True)
        return slot

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.capacity or slot in self._free:
            raise ValueError(f"allowed-token slot {slot} is not in use")
        self._free.append(slot)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        mask = torch.zeros(capacity, self.vocab_size, dtype=torch.bool, device=self.device)
        mask[:old].copy_(self.mask)
        self.mask = mask
        self._free = list(range(capacity - 1, old - 1, -1)) + self._free


class RecentTokenPool:
    """(N, width) int64: each slot's last `width` output tokens, oldest first, newest last.

    Entries before the request's first output token hold -1; the sampler knows each row's output
    count and only compares the entries it covers.
    """

    def __init__(self, width: int, device: torch.device | str) -> None:
        if width < 1:
            raise ValueError(f"the recent-token window needs width >= 1, got {width}")
        self.width = width
        self.device = torch.device(device)
        self.tokens = torch.full((0, width), -1, dtype=torch.int64, device=self.device)  # (N, W)
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return int(self.tokens.shape[0])

    def acquire(self, output_token_ids: Sequence[int]) -> int:
        """A slot holding the tail of what the request generated so far (a resume's tokens)."""
        if not self._free:
            self._grow(max(4, 2 * self.capacity))
        slot = self._free.pop()
        tail = np.full(self.width, -1, np.int64)  # (W,)
        out = np.asarray(output_token_ids, dtype=np.int64).reshape(-1)[-self.width:]
        if out.size:
            tail[self.width - out.size:] = out
        self.tokens[slot].copy_(to_device(tail, self.device))
        return slot

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.capacity or slot in self._free:
            raise ValueError(f"recent-token slot {slot} is not in use")
        self._free.append(slot)

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Shift token_ids[i] into slot slots[i]'s window, on the device (no host sync)."""
        old = self.tokens.index_select(0, slots)  # (R, W)
        new = torch.cat([old[:, 1:], token_ids.to(torch.int64).unsqueeze(-1)], dim=-1)  # (R, W)
        self.tokens.index_copy_(0, slots, new)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        tokens = torch.full((capacity, self.width), -1, dtype=torch.int64, device=self.device)
        tokens[:old].copy_(self.tokens)
        self.tokens = tokens
        self._free = list(range(capacity - 1, old - 1, -1)) + self._free


def apply_allowed_tokens(x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                         mask: torch.Tensor) -> None:
    """In place: -inf on every token of x[rows[i]] outside mask[slots[i]]."""
    y = x.index_select(0, rows)  # (A, V)
    y.masked_fill_(~mask.index_select(0, slots), _NEG_INF)
    x.index_copy_(0, rows, y)


def apply_token_bitmask(x: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf on every token of x[rows[g]] whose bit is clear in bitmask[g].

    bitmask: (G, ceil(V / 32)) int32, bit t % 32 of word t // 32 allows token t (xgrammar's layout).
    """
    v = x.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)  # (32,)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (G, W, 32)
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :v].bool()  # (G, V)
    y = x.index_select(0, rows)  # (G, V)
    y.masked_fill_(~allowed, _NEG_INF)
    x.index_copy_(0, rows, y)


def apply_bad_words(x: torch.Tensor, seq_rows: torch.Tensor, seq_slots: torch.Tensor,
                    prefixes: torch.Tensor, last_tokens: torch.Tensor, recent: torch.Tensor) -> None:
    """In place: ban last_tokens[q] in row seq_rows[q] when that row's recent output tokens end
    with the sequence's prefix.

    prefixes: (Q, K) the sequences' tokens but the last, right-aligned, -1 before them (K may be
    0); recent: the (N, W >= K) window pool, whose -1 entries (no output yet) match no prefix token.
    """
    k = prefixes.shape[1]
    if k:
        tail = recent.index_select(0, seq_slots)[:, recent.shape[1] - k:]  # (Q, K)
        match = ((tail == prefixes) | (prefixes < 0)).all(dim=-1)  # (Q,)
        # NOTE: adding 0 or -inf with accumulate is safe when several sequences end in one token.
        ban = torch.zeros(match.shape, dtype=x.dtype, device=x.device).masked_fill_(match, _NEG_INF)
    else:  # every sequence is one token long: always banned
        ban = x.new_full((), _NEG_INF).expand(seq_rows.shape[0])  # (Q,)
    x.index_put_((seq_rows, last_tokens), ban, accumulate=True)
