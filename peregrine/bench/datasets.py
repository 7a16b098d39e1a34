"""Serving-benchmark workloads as token-id prompts (no tokenizer needed on the client).

- random: prompt and output lengths drawn uniformly from [L * (1 - r), L * (1 + r)] (r is
  --random-range-ratio); token ids uniform in [min_token_id, vocab_size).
  W3 uses input_len=200, output_len=180, r=0.1: prompts 180..220 tokens, outputs 162..198.
- prefix-shared: one random prefix of prefix_len tokens shared by every prompt, then a random
  per-request suffix of suffix_len tokens (W4: 2000 + 100), outputs of output_len tokens.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

DATASETS = ("random", "prefix-shared")


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt token ids and how many tokens to generate."""

    prompt: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def _span(length: int, ratio: float) -> tuple[int, int]:
    if length < 1:
        raise ValueError(f"lengths must be >= 1, got {length}")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {ratio}")
    return max(1, round(length * (1 - ratio))), max(1, round(length * (1 + ratio)))


def _check_vocab(vocab_size: int, min_token_id: int) -> None:
    if not 0 <= min_token_id < vocab_size:
        raise ValueError(f"need 0 <= min_token_id ({min_token_id}) < vocab_size ({vocab_size})")


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   vocab_size: int, seed: int, min_token_id: int = 10) -> list[BenchRequest]:
    """Random prompts of random lengths around input_len; outputs around output_len."""
    _check_vocab(vocab_size, min_token_id)
    rng = random.Random(seed)
    in_lo, in_hi = _span(input_len, range_ratio)
    out_lo, out_hi = _span(output_len, range_ratio)
    reqs = []
    for _ in range(num_prompts):
        n = rng.randint(in_lo, in_hi)
        prompt = [rng.randrange(min_token_id, vocab_size) for _ in range(n)]
        reqs.append(BenchRequest(prompt, rng.randint(out_lo, out_hi)))
    return reqs


def prefix_shared_dataset(num_prompts: int, prefix_len: int, suffix_len: int, output_len: int,
                          vocab_size: int, seed: int, min_token_id: int = 10) -> list[BenchRequest]:
    """A shared prefix_len-token prefix plus a unique suffix_len-token part per request."""
    _check_vocab(vocab_size, min_token_id)
    if prefix_len < 0 or suffix_len < 1 or output_len < 1:
        raise ValueError("need prefix_len >= 0, suffix_len >= 1 and output_len >= 1")
    rng = random.Random(seed)
    prefix = [rng.randrange(min_token_id, vocab_size) for _ in range(prefix_len)]
    return [BenchRequest(prefix + [rng.randrange(min_token_id, vocab_size)
                                   for _ in range(suffix_len)], output_len)
            for _ in range(num_prompts)]
