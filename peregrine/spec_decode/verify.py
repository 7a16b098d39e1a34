"""Lossless verification of one-hot drafts inside the running batch.

A verify step computes the target's logits after the last real token and after each of the d
drafts, and samples every position as a row of its own, keyed on the request's seed and that
position's token index exactly as a plain decode step would key it. The drafts are accepted while
the sampled token equals the draft; the first mismatch (or the position after the last draft)
contributes its sampled token, so a request emits accepted + 1 tokens.

Why this is exact: the sampler draws with the exponential race (sample/sampler.py), a
deterministic function of (seed, token index) and the position's distribution p. Accepting x when
the draw equals x happens with probability p(x), and on a mismatch the draw is distributed as p
restricted to the other tokens, renormalised: this is rejection sampling for a one-hot proposal,
so the output is distributed as the target's. More: position i's draw is the very token a plain
decode would sample at that index, so a seeded request gives the same tokens with and without
speculation (greedy is the special case).
"""
from __future__ import annotations

import numpy as np


def accepted_counts(sampled: np.ndarray, draft_tokens: np.ndarray,
                    counts: np.ndarray) -> np.ndarray:
    """(S,) int64: how many leading drafts of each sampled row its sampled tokens confirm.

    sampled: (S',) the tokens drawn at every logits row; draft_tokens: (S',) the draft each row's
    token must equal (-1 at a row's last position); counts: (S,) logits rows per sampled row.
    Computed on the host from the step's tokens (there anyway), not with a chain of small
    device operations.
    """
    num_rows = int(counts.sum())
    if sampled.shape != (num_rows,) or draft_tokens.shape != (num_rows,):
        raise ValueError(f"{num_rows} logits rows expected, got sampled {tuple(sampled.shape)} "
                         f"and drafts {draft_tokens.shape}")
    first = np.cumsum(counts) - counts  # (S,) each sampled row's first logits row
    if counts.size and not (draft_tokens[first + counts - 1] < 0).all():
        raise ValueError("each sampled row's last position must have draft -1 (nothing to "
                         "confirm there)")
    # NOTE: that -1 never equals a token, so every row has a mismatch: its first one, counted
    # from the row's start, is the number of drafts confirmed.
    mismatches = np.flatnonzero(sampled != draft_tokens)  # (M,) ascending
    return mismatches[np.searchsorted(mismatches, first)] - first  # (S,)
