"""Token streams and cross-entropy (nats per token) for the demo model and its unigram baseline."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from peregrine.demo.checkpoint import BOS_ID, EOS_ID

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """One int64 stream: bos, the text's tokens, eos, for each text in order."""
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    pieces: list[int] = []
    for enc in encodings:
        pieces.append(BOS_ID)
        pieces.extend(enc.ids)
        pieces.append(EOS_ID)
    return torch.tensor(pieces, dtype=torch.int64)  # (N,)


def eval_windows(stream: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Consecutive windows of seq_len + 1 tokens overlapping by one, so every token after the
    first is predicted exactly once; the last window may be shorter."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if stream.numel() < 2:
        raise ValueError("the evaluation stream needs at least two tokens")
    return [stream[s:s + seq_len + 1] for s in range(0, stream.numel() - 1, seq_len)]


@torch.no_grad()
def model_cross_entropy(model: torch.nn.Module, stream: torch.Tensor, seq_len: int, *,
                        batch_size: int = 16, max_tokens: int | None = None) -> float:
    """Mean next-token cross-entropy (nats) of a transformers causal LM over the stream."""
    if max_tokens is not None:
        stream = stream[:max_tokens + 1]
    device = next(model.parameters()).device
    windows = eval_windows(stream, seq_len)
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        group = windows[i:i + batch_size]
        full = [w for w in group if w.numel() == seq_len + 1]
        batches = [torch.stack(full)] if full else []
        batches += [w[None] for w in group if w.numel() != seq_len + 1]
        for batch in batches:
            batch = batch.to(device)  # (B, L + 1)
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits.float()  # (B, L, V)
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            total += float(loss)
            count += batch[:, 1:].numel()
    return total / count


def unigram_log_probs(train_stream: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Add-one smoothed log-probabilities of each token id, counted over the training stream."""
    counts = torch.bincount(train_stream, minlength=vocab_size).double()  # (V,)
    if counts.numel() != vocab_size:
        raise ValueError(f"token ids exceed vocab_size {vocab_size}")
    return torch.log((counts + 1.0) / (counts.sum() + vocab_size))


def unigram_cross_entropy(log_probs: torch.Tensor, stream: torch.Tensor) -> float:
    """Mean cross-entropy (nats) of the unigram model on the tokens a model would predict."""
    if stream.numel() < 2:
        raise ValueError("the evaluation stream needs at least two tokens")
    return float(-log_probs[stream[1:]].mean())
