"""Per-step sampling tensors for a batch of requests, plus host-side flags that let the sampler skip stages."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from peregrine.engine.request import Request

_U64 = (1 << 64) - 1


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step; row b describes the request at row b of the logits."""

    # (B,) float32; 1.0 on greedy rows so that the division is harmless.
    temperature: torch.Tensor
    # (B,) bool: rows that take the argmax of the penalised logits. None when no row is greedy.
    greedy_mask: torch.Tensor | None
    # (B,) int64 in [0, V]; 0: disabled. Greedy rows hold 1 (their result is replaced anyway).
    top_k: torch.Tensor
    top_p: torch.Tensor  # (B,) float32 in (0, 1]; 1: disabled
    min_p: torch.Tensor  # (B,) float32 in [0, 1]; 0: disabled
    seeds: torch.Tensor  # (B,) int64: the request's seed, wrapped to 64 bits
    steps: torch.Tensor  # (B,) int64: output tokens so far; keys the random stream of this step
    # Penalties: None unless some row uses them.
    presence_penalties: torch.Tensor | None = None  # (B,) float32
    frequency_penalties: torch.Tensor | None = None  # (B,) float32
    repetition_penalties: torch.Tensor | None = None  # (B,) float32
    prompt_token_mask: torch.Tensor | None = field(default=None, repr=False)  # (B, V) bool: in the prompt
    output_token_counts: torch.Tensor | None = field(default=None, repr=False)  # (B, V) int32: output counts
    # min_tokens: (row, token) pairs whose logit is set to -inf this step. None when nothing is banned.
    banned_rows: torch.Tensor | None = None  # (N,) int64
    banned_tokens: torch.Tensor | None = None  # (N,) int64
    # Host-side flags: read by the sampler without touching the device.
    all_greedy: bool = False
    any_top_k: bool = False
    all_top_k: bool = False  # every non-greedy row has top_k > 0
    max_top_k: int = 0  # largest top_k over non-greedy rows (clamped to V)
    any_top_p: bool = False
    any_min_p: bool = False
    any_penalties: bool = False
    any_repetition_penalty: bool = False
    any_presence_frequency: bool = False
    any_min_tokens: bool = False
    max_num_logprobs: int | None = None  # K: largest `logprobs` in the batch; None: nobody asked

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])


def seed_to_int64(seed: int) -> int:
    """Wrap any Python int seed to the signed 64-bit range (same bits modulo 2**64)."""
    s = seed & _U64
    return s - (1 << 64) if s >= (1 << 63) else s


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    cpu = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        # NOTE: pinned + non_blocking keeps the copy off the host's critical path (no sync).
        return cpu.pin_memory().to(device, non_blocking=True)
    return cpu.to(device)


def _token_rows(token_lists: list[list[int]], rows: list[int], device: torch.device,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row token lists into (row index, token id) tensors on `device`."""
    lengths = [len(t) for t in token_lists]
    total = sum(lengths)
    flat = np.empty((2, total), dtype=np.int64)  # (2, N): row index, token id
    flat[0] = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    flat[1] = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=total)
    cpu = torch.from_numpy(flat)
    out = cpu.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else cpu
    return out[0], out[1]


def _build_penalty_counts(requests: list[Request], rows: list[int], vocab_size: int,
                          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) prompt-occurrence mask and output counts, filled only for `rows`."""
    batch = len(requests)
    # NOTE: one spare column V collects out-of-range ids, so nothing is filtered with a (syncing) mask.
    prompt_mask = torch.zeros(batch, vocab_size + 1, dtype=torch.bool, device=device)  # (B, V+1)
    counts = torch.zeros(batch, vocab_size + 1, dtype=torch.int32, device=device)  # (B, V+1)
    if rows:
        r, t = _token_rows([requests[i].prompt_token_ids for i in rows], rows, device)
        prompt_mask.index_put_((r, t.clamp(0, vocab_size)), torch.ones((), dtype=torch.bool, device=device))
        r, t = _token_rows([requests[i].output_token_ids for i in rows], rows, device)
        counts.index_put_((r, t.clamp(0, vocab_size)), torch.ones((), dtype=torch.int32, device=device),
                          accumulate=True)
    return prompt_mask[:, :vocab_size], counts[:, :vocab_size]


def build_sampling_metadata(requests: list[Request], vocab_size: int,
                            device: torch.device | str) -> SamplingMetadata:
    """Build the step's sampling tensors for `requests` (row b = requests[b]) on `device`."""
    device = torch.device(device)
    if not requests:
        raise ValueError("build_sampling_metadata needs at least one request")
    float_rows: list[tuple[float, ...]] = []  # temperature, top_p, min_p, presence, frequency, repetition
    int_rows: list[tuple[int, ...]] = []  # top_k, seed, step, is_greedy
    sampled_top_ks: list[int] = []  # top_k of the non-greedy rows (0: none)
    penalty_rows: list[int] = []
    banned_rows: list[int] = []
    banned_tokens: list[int] = []
    max_logprobs: int | None = None
    any_top_p = any_min_p = any_rep = any_pf = False
    for row, req in enumerate(requests):
        p = req.sampling_params
        if p.is_greedy:
            # NOTE: greedy rows get neutral values; their token is the argmax, whatever the filters say.
            temperature, top_k, top_p, min_p = 1.0, 1, 1.0, 0.0
        else:
            temperature, top_p, min_p = p.temperature, p.top_p, p.min_p
            top_k = min(p.top_k, vocab_size) if p.top_k > 0 else 0
            sampled_top_ks.append(top_k)
            any_top_p |= top_p < 1.0
            any_min_p |= min_p > 0.0
        float_rows.append((temperature, top_p, min_p, p.presence_penalty, p.frequency_penalty,
                           p.repetition_penalty))
        int_rows.append((top_k, seed_to_int64(req.seed), req.num_output_tokens, int(p.is_greedy)))
        row_rep = p.repetition_penalty != 1.0
        row_pf = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        any_rep |= row_rep
        any_pf |= row_pf
        if row_rep or row_pf:
            penalty_rows.append(row)
        if req.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                banned.update(req.eos_token_ids)
            banned = sorted(t for t in banned if 0 <= t < vocab_size)
            banned_rows.extend([row] * len(banned))
            banned_tokens.extend(banned)
        if p.logprobs is not None:
            max_logprobs = p.logprobs if max_logprobs is None else max(max_logprobs, p.logprobs)

    all_greedy = not sampled_top_ks
    any_greedy = len(sampled_top_ks) < len(requests)
    any_penalties = any_rep or any_pf
    # NOTE: one host->device copy per dtype instead of one per field.
    floats = _to_device(list(zip(*float_rows)), torch.float32, device)  # (6, B)
    ints = _to_device(list(zip(*int_rows)), torch.int64, device)  # (4, B)
    meta = SamplingMetadata(
        temperature=floats[0],
        greedy_mask=ints[3].bool() if any_greedy else None,
        top_k=ints[0],
        top_p=floats[1],
        min_p=floats[2],
        seeds=ints[1],
        steps=ints[2],
        all_greedy=all_greedy,
        any_top_k=any(k > 0 for k in sampled_top_ks),
        all_top_k=bool(sampled_top_ks) and all(k > 0 for k in sampled_top_ks),
        max_top_k=max(sampled_top_ks, default=0),
        any_top_p=any_top_p,
        any_min_p=any_min_p,
        any_penalties=any_penalties,
        any_repetition_penalty=any_rep,
        any_presence_frequency=any_pf,
        any_min_tokens=bool(banned_rows),
        max_num_logprobs=max_logprobs,
    )
    if any_penalties:
        meta.presence_penalties, meta.frequency_penalties = floats[3], floats[4]
        meta.repetition_penalties = floats[5]
        meta.prompt_token_mask, meta.output_token_counts = _build_penalty_counts(
            requests, penalty_rows, vocab_size, device)
    if banned_rows:
        meta.banned_rows, meta.banned_tokens = _to_device([banned_rows, banned_tokens], torch.int64, device)
    return meta
