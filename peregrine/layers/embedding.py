"""Vocab-parallel token embedding and LM head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from peregrine.distributed import tp_all_gather, tp_all_reduce, tp_rank, tp_size


def _vocab_range(vocab_size: int) -> tuple[int, int]:
    per_rank = -(-vocab_size // tp_size())
    start = tp_rank() * per_rank
    return start, min(start + per_rank, vocab_size)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary's rows."""

    def __init__(self, vocab_size: int, hidden: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.start, self.end = _vocab_range(vocab_size)
        rows = -(-vocab_size // tp_size())  # padded so every rank has the same shape
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start  # (T,)
        mask = (input_ids < self.start) | (input_ids >= self.end)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)  # (T, hidden)
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return tp_all_reduce(out)

    def load_full(self, param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
        if loaded.dim() != 2 or loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(loaded.shape)} does not "
                             f"match the model's {(self.vocab_size, param.shape[1])}")
        n = self.end - self.start
        param.data[:n].copy_(loaded[self.start:self.end])
        param.data[n:].zero_()


# NOTE: on CUDA, one rank and a 16-bit head, the GEMM writes float32 logits itself (its float32
# sums rounded once) instead of writing 16-bit logits that a second pass converts: at W1's
# batches that pass was ~70 us a decode step. False: the two-pass form (benchmarks compare them).
FP32_OUT_GEMM = True


class ParallelLMHead(VocabParallelEmbedding):
    """Computes float32 logits over the whole vocabulary (gathered across ranks)."""

    def _fp32_out(self, hidden: torch.Tensor) -> bool:
        return (FP32_OUT_GEMM and hidden.is_cuda and tp_size() == 1 and hidden.dim() == 2
                and hidden.dtype in (torch.bfloat16, torch.float16) and self.weight.dtype == hidden.dtype)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """(N, V) float32 logits of hidden (N, hidden); into out (N, V) float32 when given."""
        if self._fp32_out(hidden):
            weight_t = self.weight[: self.vocab_size].t()  # (hidden, V) view
            if out is None:
                return torch.mm(hidden, weight_t, out_dtype=torch.float32)  # (N, V)
            return torch.mm(hidden, weight_t, out_dtype=torch.float32, out=out)
        logits = F.linear(hidden, self.weight)  # (N, rows)
        if tp_size() > 1:
            logits = tp_all_gather(logits, dim=-1)
        if out is None:
            return logits[:, : self.vocab_size].float()  # (N, V)
        return out.copy_(logits[:, : self.vocab_size])  # one conversion, into out
