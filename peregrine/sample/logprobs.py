"""Logprobs of chosen tokens, their ranks, and the top-k alternatives, from raw logits."""
from __future__ import annotations

from typing import NamedTuple

import torch

# NOTE: bounds the (rows, V) float32 temporaries of long prompts (prompt_logprobs) to ~256 MiB.
_MAX_CHUNK_ELEMENTS = 1 << 26


class LogprobsTensors(NamedTuple):
    token_ids: torch.Tensor  # (N, k+1) int64: column 0 is the target token, columns 1..k the top-k
    logprobs: torch.Tensor  # (N, k+1) float32
    ranks: torch.Tensor  # (N,) int64: rank of the target token (1 = most likely)


def _token_logprobs_chunk(logits: torch.Tensor, target_ids: torch.Tensor, k: int) -> LogprobsTensors:
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    target = target_ids.long().unsqueeze(-1)  # (N, 1)
    target_lp = logprobs.gather(-1, target)  # (N, 1)
    # NOTE: strictly larger, so ties share the better rank.
    ranks = (logprobs > target_lp).sum(-1) + 1  # (N,)
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)  # (N, k), (N, k)
        ids = torch.cat([target, top_ids], dim=-1)  # (N, k+1)
        return LogprobsTensors(ids, torch.cat([target_lp, top_lp], dim=-1), ranks)
    return LogprobsTensors(target, target_lp, ranks)


def compute_token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Logprob and rank of `target_ids` under log_softmax(logits), plus each row's top-`k` tokens."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (N, V), got shape {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    k = min(k, vocab)
    chunk = max(1, _MAX_CHUNK_ELEMENTS // max(vocab, 1))
    if num_rows <= chunk:
        return _token_logprobs_chunk(logits, target_ids, k)
    # NOTE: a loop over row chunks (not rows): bounds memory for prompt_logprobs of long prompts.
    parts = [_token_logprobs_chunk(logits[i:i + chunk], target_ids[i:i + chunk], k)
             for i in range(0, num_rows, chunk)]
    return LogprobsTensors(*(torch.cat(list(p), dim=0) for p in zip(*parts)))
