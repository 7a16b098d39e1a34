"""Per-step sampling tensors for a batch of requests, plus host-side flags that let the sampler skip stages."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
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
    # logit_bias: (row, token, bias) triples added to the logits. None when no row has a bias.
    bias_rows: torch.Tensor | None = None  # (M,) int64
    bias_tokens: torch.Tensor | None = None  # (M,) int64
    bias_values: torch.Tensor | None = None  # (M,) float32
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
    any_logit_bias: bool = False
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


# Per-request values the step needs, each read by one C-level call per request.
_PARAMS = attrgetter("sampling_params")
_OUTPUT_IDS = attrgetter("output_token_ids")
_SEED = attrgetter("seed")
_BIAS = attrgetter("logit_bias")
_ROW = attrgetter("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "min_tokens", "logprobs")
_TEMP, _TOP_K, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION, _MIN_TOKENS, _LOGPROBS = range(9)
_GREEDY_TEMPERATURE = 1e-5  # SamplingParams.is_greedy: temperature below this


def _has_penalty(row: tuple) -> bool:
    return row[_REPETITION] != 1.0 or row[_PRESENCE] != 0.0 or row[_FREQUENCY] != 0.0


def _seeds(requests: list[Request]) -> list[int]:
    seeds = list(map(_SEED, requests))
    if min(seeds) < -(1 << 63) or max(seeds) >= (1 << 63):
        seeds = [seed_to_int64(s) for s in seeds]
    return seeds


def _banned_pairs(requests: list[Request], rows: list[int], vocab_size: int) -> tuple[list[int], list[int]]:
    """(row, token) pairs min_tokens bans this step, for the (few) rows still below their min_tokens."""
    banned_rows: list[int] = []
    banned_tokens: list[int] = []
    for row in rows:
        req = requests[row]
        p = req.sampling_params
        banned = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            banned.update(req.eos_token_ids)
        banned = sorted(t for t in banned if 0 <= t < vocab_size)
        banned_rows.extend([row] * len(banned))
        banned_tokens.extend(banned)
    return banned_rows, banned_tokens


def build_sampling_metadata(requests: list[Request], vocab_size: int, device: torch.device | str,
                            steps: Sequence[int] | None = None) -> SamplingMetadata:
    """Build the step's sampling tensors for `requests` (row b = requests[b]) on `device`.

    steps: per row, the number of output tokens before the one sampled now (keys the random stream and
    min_tokens); default len(req.output_token_ids), which lags by one while a token is still in flight.
    """
    device = torch.device(device)
    if not requests:
        raise ValueError("build_sampling_metadata needs at least one request")
    batch = len(requests)
    if steps is None:
        steps = list(map(len, map(_OUTPUT_IDS, requests)))
    elif len(steps) != batch:
        raise ValueError(f"steps has {len(steps)} entries for {batch} requests")
    rows = list(map(_ROW, map(_PARAMS, requests)))  # one tuple of settings per request
    # NOTE: the host flags depend only on the distinct settings: one row in the common uniform batch.
    uniform = rows.count(rows[0]) == batch
    distinct = [rows[0]] if uniform else list(dict.fromkeys(rows))
    sampled = [r for r in distinct if r[_TEMP] >= _GREEDY_TEMPERATURE]
    top_ks = [min(r[_TOP_K], vocab_size) for r in sampled]  # 0: no top-k
    any_penalties = any(map(_has_penalty, distinct))
    requested = [r[_LOGPROBS] for r in distinct if r[_LOGPROBS] is not None]

    # NOTE: one buffer holds every per-row value: on CUDA it is allocated pinned and filled in place,
    # then sent in one non-blocking copy (no sync); the tensors below are views of its device copy.
    n_int, n_float = 3 * 8 * batch, 6 * 4 * batch
    host = torch.empty(n_int + n_float + batch, dtype=torch.uint8, pin_memory=device.type == "cuda")
    buf = host.numpy()
    ints = buf[:n_int].view(np.int64).reshape(3, batch)  # top_k, seed, step
    floats = buf[n_int:n_int + n_float].view(np.float32).reshape(6, batch)  # temp, top_p, min_p, penalties
    greedy = buf[n_int + n_float:].view(np.bool_)  # (B,)
    ints[1] = _seeds(requests)
    ints[2] = steps
    # NOTE: greedy rows get neutral values; their token is the argmax, whatever the filters say.
    if uniform:  # plain scalars, broadcast
        r = rows[0]
        greedy[:] = is_greedy = not sampled
        ints[0] = 1 if is_greedy else min(r[_TOP_K], vocab_size)
        floats[:3] = np.array([[1.0], [1.0], [0.0]] if is_greedy else [[r[_TEMP]], [r[_TOP_P]], [r[_MIN_P]]])
        floats[3:] = np.array([[r[_PRESENCE]], [r[_FREQUENCY]], [r[_REPETITION]]])
    else:
        cols = list(zip(*rows))  # one tuple per field
        greedy[:] = np.less(cols[_TEMP], _GREEDY_TEMPERATURE)
        ints[0] = np.where(greedy, 1, np.minimum(cols[_TOP_K], vocab_size))
        floats[0] = np.where(greedy, 1.0, cols[_TEMP])
        floats[1] = np.where(greedy, 1.0, cols[_TOP_P])
        floats[2] = np.where(greedy, 0.0, cols[_MIN_P])
        floats[3], floats[4], floats[5] = cols[_PRESENCE], cols[_FREQUENCY], cols[_REPETITION]
    dev = host.to(device, non_blocking=True) if device.type != "cpu" else host
    top_k_t, seeds_t, steps_t = dev[:n_int].view(torch.int64).view(3, batch).unbind(0)
    temp_t, top_p_t, min_p_t, presence_t, frequency_t, repetition_t = (
        dev[n_int:n_int + n_float].view(torch.float32).view(6, batch).unbind(0))
    meta = SamplingMetadata(
        temperature=temp_t,
        greedy_mask=dev[n_int + n_float:].view(torch.bool) if len(sampled) < len(distinct) else None,
        top_k=top_k_t,
        top_p=top_p_t,
        min_p=min_p_t,
        seeds=seeds_t,
        steps=steps_t,
        all_greedy=not sampled,
        any_top_k=any(top_ks),
        all_top_k=bool(top_ks) and all(top_ks),
        max_top_k=max(top_ks, default=0),
        any_top_p=any(r[_TOP_P] < 1.0 for r in sampled),
        any_min_p=any(r[_MIN_P] > 0.0 for r in sampled),
        any_penalties=any_penalties,
        any_repetition_penalty=any(r[_REPETITION] != 1.0 for r in distinct),
        any_presence_frequency=any(r[_PRESENCE] != 0.0 or r[_FREQUENCY] != 0.0 for r in distinct),
        max_num_logprobs=max(requested, default=None),
    )
    if any_penalties:
        meta.presence_penalties, meta.frequency_penalties = presence_t, frequency_t
        meta.repetition_penalties = repetition_t
        penalty_rows = [i for i, r in enumerate(rows) if _has_penalty(r)]
        meta.prompt_token_mask, meta.output_token_counts = _build_penalty_counts(
            requests, penalty_rows, vocab_size, device)
    biases = list(map(_BIAS, map(_PARAMS, requests)))
    if any(biases):
        b_rows, b_tokens, b_values = [], [], []
        for row, bias in enumerate(biases):
            for tok, value in (bias or {}).items():
                if 0 <= tok < vocab_size:
                    b_rows.append(row)
                    b_tokens.append(tok)
                    b_values.append(float(value))
        if b_rows:
            meta.any_logit_bias = True
            meta.bias_rows, meta.bias_tokens = _to_device([b_rows, b_tokens], torch.int64, device)
            meta.bias_values = _to_device(b_values, torch.float32, device)
    if max(r[_MIN_TOKENS] for r in distinct) > 0:
        banned_rows, banned_tokens = _banned_pairs(
            requests, [i for i, (r, n) in enumerate(zip(rows, steps)) if n < r[_MIN_TOKENS]], vocab_size)
        if banned_rows:
            meta.any_min_tokens = True
            meta.banned_rows, meta.banned_tokens = _to_device([banned_rows, banned_tokens], torch.int64,
                                                              device)
    return meta
