"""The n-gram proposer: longest suffix in [min, max], most recent earlier occurrence."""
from __future__ import annotations

import numpy as np

from peregrine.spec_decode.ngram import ngram_propose


def _naive(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    n = len(tokens)
    for size in range(min(hi, n - 1), lo - 1, -1):
        suffix = tokens[n - size:]
        for start in range(n - size - 1, -1, -1):
            if tokens[start:start + size] == suffix:
                return tokens[start + size:start + size + k]
    return []


def test_longest_suffix_wins_over_a_more_recent_shorter_one() -> None:
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [7, 1, 2, 3, 40, 41, 9, 2, 3, 50, 1, 2, 3]
    # "1 2 3" occurred at 1..3 (followed by 40 41); "2 3" more recently at 7..8 (followed by 50)
    assert ngram_propose(np.array(tokens), 2, 2, 3).tolist() == [40, 41]
    assert ngram_propose(np.array(tokens), 2, 2, 2).tolist() == [50, 1]


def test_most_recent_occurrence_and_short_continuations() -> None:
    tokens = [1, 2, 8, 1, 2, 9, 1, 2]
    assert ngram_propose(np.array(tokens), 3, 2, 2).tolist() == [9, 1, 2]
    assert ngram_propose(np.array([4, 4]), 3, 1, 1).tolist() == [4]


def test_nothing_below_prompt_lookup_min() -> None:
    assert ngram_propose(np.array([1, 2, 3, 9, 3]), 4, 2, 4).size == 0
    assert ngram_propose(np.array([1, 2, 3, 9, 3]), 4, 1, 4).tolist() == [9, 3]
    assert ngram_propose(np.array([5]), 4, 1, 4).size == 0


def test_matches_a_naive_search_on_random_sequences() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        tokens = rng.integers(0, 4, n).tolist()
        k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        assert ngram_propose(np.array(tokens), k, lo, hi).tolist() == _naive(tokens, k, lo, hi)


def test_search_is_bounded_to_a_window() -> None:
    tokens = np.array([1, 2, 77] + [5, 6] * 10 + [1, 2])
    assert ngram_propose(tokens, 1, 2, 2).tolist() == [77]
    assert ngram_propose(tokens, 1, 2, 2, window=10).size == 0
