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
    width = int(counts.max())
    first = np.zeros(counts.size, np.int64)  # (S,)
    np.cumsum(counts[:-1], out=first[1:])
    col = np.arange(width, dtype=np.int64)  # (W,)
    # (S, W) flat row of each (sampled row, position); past a row's end: num_rows (a mismatch).
    idx = np.where(col < counts[:, None], first[:, None] + col, num_rows)
    match = np.append(sampled == draft_tokens, False)  # (S' + 1,)
    return np.cumprod(match[idx], axis=1, dtype=np.int64).sum(axis=1)  # (S,)
