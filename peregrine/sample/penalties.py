"""Device-side penalty state: one slot per request with penalties, kept across steps.

A slot holds the request's prompt-occurrence mask and its output-token counts over the vocabulary.
Both are built once when the request arrives; after each sampling step the sampled tokens are added
to the counts on the device, so the counts are exact even while a step's tokens are still in flight.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from peregrine.transfer import to_device


class PenaltyPool:
    """(N, V) prompt masks and output counts; slots are handed out on demand and the pool grows."""

    def __init__(self, vocab_size: int, device: torch.device | str, capacity: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.prompt_mask = torch.zeros(capacity, vocab_size, dtype=torch.bool,
                                       device=self.device)  # (N, V)
        self.counts = torch.zeros(capacity, vocab_size, dtype=torch.int32,
                                  device=self.device)  # (N, V)
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return int(self.counts.shape[0])

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def acquire(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> int:
        """A slot filled from the request's prompt and the output it already has (a resume)."""
        if not self._free:
            self._grow(max(4, 2 * self.capacity))
        slot = self._free.pop()
        self.prompt_mask[slot].zero_()
        self.counts[slot].zero_()
        prompt = self._in_vocab(prompt_token_ids)
        if prompt.size:
            self.prompt_mask[slot].index_fill_(0, to_device(prompt, self.device), True)
        output = self._in_vocab(output_token_ids)
        if output.size:
            ones = torch.ones(output.size, dtype=torch.int32, device=self.device)
            self.counts[slot].index_add_(0, to_device(output, self.device), ones)
        return slot

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.capacity or slot in self._free:
            raise ValueError(f"penalty slot {slot} is not in use")
        self._free.append(slot)

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """counts[slots[i], token_ids[i]] += 1, on the device (no host sync)."""
        flat = slots * self.vocab_size + token_ids  # (P,)
        ones = torch.ones((), dtype=torch.int32, device=self.device).expand(flat.shape[0])
        self.counts.view(-1).index_add_(0, flat, ones)

    def _in_vocab(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)  # (N,)
        return ids[(ids >= 0) & (ids < self.vocab_size)]

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        mask = torch.zeros(capacity, self.vocab_size, dtype=torch.bool, device=self.device)
        counts = torch.zeros(capacity, self.vocab_size, dtype=torch.int32, device=self.device)
        mask[:old].copy_(self.prompt_mask)
        counts[:old].copy_(self.counts)
        self.prompt_mask, self.counts = mask, counts
        self._free = list(range(capacity - 1, old - 1, -1)) + self._free
