"""Sampling metadata: per-row settings kept across steps, and each step's tensors built from them.

`SamplingRows` holds the sampling settings of a persistent batch's rows as host arrays (set once when
a request arrives), the device-side penalty state of the rows that use penalties, the allowed-token
masks and recent output tokens of rows with allowed_token_ids or bad_words (constraints.py), and
each row's logit_bias, bad-word token sequences and min_tokens bans. A step's `SamplingMetadata` is
cut from those rows: the per-row tensors go to the device once per batch composition and are reused
while it does not change; per step only the sampling step indices (and min_tokens bans, while a
row is below its minimum) move.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from peregrine.sample.constraints import AllowedTokenPool, RecentTokenPool
from peregrine.sample.penalties import PenaltyPool
from peregrine.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams
from peregrine.transfer import upload

_U64 = (1 << 64) - 1
_GREEDY_TEMPERATURE = 1e-5  # SamplingParams.is_greedy: temperature below this


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
    # (B,) int64: output tokens so far; keys the random stream of this step. None on a step whose
    # rows are all greedy (no draw reads it).
    steps: torch.Tensor | None
    # Penalties: None unless some row uses them; only the P rows that do are touched.
    penalty_rows: torch.Tensor | None = None  # (P,) int64: rows of this batch
    penalty_slots: torch.Tensor | None = None  # (P,) int64: their slots in the two pools below
    presence_penalties: torch.Tensor | None = None  # (P,) float32
    frequency_penalties: torch.Tensor | None = None  # (P,) float32
    repetition_penalties: torch.Tensor | None = None  # (P,) float32
    prompt_token_mask: torch.Tensor | None = field(default=None, repr=False)  # (N, V) bool pool
    output_token_counts: torch.Tensor | None = field(default=None, repr=False)  # (N, V) int32 pool
    # min_tokens: (row, token) pairs whose logit is set to -inf this step. None when nothing is banned.
    banned_rows: torch.Tensor | None = None  # (N,) int64
    banned_tokens: torch.Tensor | None = None  # (N,) int64
    # logit_bias: (row, token, bias) triples added to the logits. None when no row has a bias.
    bias_rows: torch.Tensor | None = None  # (M,) int64
    bias_tokens: torch.Tensor | None = None  # (M,) int64
    bias_values: torch.Tensor | None = None  # (M,) float32
    # allowed_token_ids: rows whose tokens outside their mask get -inf. None when no row has a list.
    allowed_rows: torch.Tensor | None = None  # (A,) int64: rows of this batch
    allowed_slots: torch.Tensor | None = None  # (A,) int64: their slots in the pool below
    allowed_mask: torch.Tensor | None = field(default=None, repr=False)  # (N, V) bool pool
    # bad_words: one entry per token sequence of the rows that have some. None when no row has any.
    bad_word_rows: torch.Tensor | None = None  # (Q,) int64: rows of this batch
    bad_word_slots: torch.Tensor | None = None  # (Q,) int64: their slots in the window pool
    bad_word_prefixes: torch.Tensor | None = None  # (Q, K) int64: all tokens but the last; -1 pads
    bad_word_last: torch.Tensor | None = None  # (Q,) int64: the token banned when the prefix matches
    recent_rows: torch.Tensor | None = None  # (R,) int64: rows whose window takes this step's token
    recent_slots: torch.Tensor | None = None  # (R,) int64
    recent_tokens: torch.Tensor | None = field(default=None, repr=False)  # (N, W) int64 pool
    # structured outputs: rows whose tokens outside their grammar's bitmask get -inf (set per step).
    grammar_rows: torch.Tensor | None = None  # (G,) int64: rows of this batch
    grammar_bitmask: torch.Tensor | None = field(default=None, repr=False)  # (G, ceil(V/32)) int32
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
    any_allowed_tokens: bool = False
    any_bad_words: bool = False
    any_grammar: bool = False
    max_num_logprobs: int | None = None  # K: largest `logprobs` in the batch; None: nobody asked

    @property
    def changes_logits(self) -> bool:
        """Whether some row's logits are masked, biased or penalised before the draw."""
        return (self.any_allowed_tokens or self.any_bad_words or self.any_logit_bias
                or self.any_min_tokens or self.any_penalties or self.any_grammar)


def seed_to_int64(seed: int) -> int:
    """Wrap any Python int seed to the signed 64-bit range (same bits modulo 2**64)."""
    s = seed & _U64
    return s - (1 << 64) if s >= (1 << 63) else s


# Compositions (which rows sample, in which order) kept per batch: k + 1 draft counts and more.
MAX_CACHED_COMPOSITIONS = 16


@dataclass
class _Composition:
    """The part of a step's metadata that depends only on which rows sample, in which order."""

    key: tuple[int, bytes]
    meta: SamplingMetadata  # steps and bans unset
    min_token_rows: np.ndarray  # (R,) batch rows with min_tokens > 0
    min_token_limits: np.ndarray  # (R,) their min_tokens
    min_token_bans: list[np.ndarray]  # their banned token ids


class SamplingRows:
    """Sampling settings of up to `max_rows` persistent rows, and the step metadata cut from them."""

    _ARRAYS = ("temperature", "greedy", "top_k", "top_p", "min_p", "presence", "frequency",
               "repetition", "seed", "min_tokens", "num_logprobs", "penalty_slot", "has_bias", "allowed_slot",
               "recent_slot")

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        n = max_rows
        # NOTE: greedy rows hold neutral values; their token is the argmax, whatever the filters say.
        self.temperature = np.ones(n, np.float32)  # (R,)
        self.greedy = np.zeros(n, np.bool_)  # (R,)
        self.top_k = np.zeros(n, np.int64)  # (R,) clamped to V; 1 on greedy rows
        self.top_p = np.ones(n, np.float32)  # (R,)
        self.min_p = np.zeros(n, np.float32)  # (R,)
        self.presence = np.zeros(n, np.float32)  # (R,)
        self.frequency = np.zeros(n, np.float32)  # (R,)
        self.repetition = np.ones(n, np.float32)  # (R,)
        self.seed = np.zeros(n, np.int64)  # (R,)
        self.min_tokens = np.zeros(n, np.int64)  # (R,)
        self.num_logprobs = np.full(n, -1, np.int64)  # (R,) -1: no logprobs
        self.penalty_slot = np.full(n, -1, np.int64)  # (R,) -1: no penalties
        self.has_bias = np.zeros(n, np.bool_)  # (R,)
        self.bans: list[np.ndarray | None] = [None] * n  # min_tokens: stop and eos ids
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * n  # (tokens, values)
        self.allowed_slot = np.full(n, -1, np.int64)  # (R,) -1: no allowed_token_ids
        self.recent_slot = np.full(n, -1, np.int64)  # (R,) -1: no bad words
        # bad_words: per row, (prefixes (n, W) right-aligned with -1 padding, last tokens (n,),
        # longest prefix); W = the window's width.
        self.bad_words: list[tuple[np.ndarray, np.ndarray, int] | None] = [None] * n
        self.penalties = PenaltyPool(vocab_size, self.device)
        self.allowed = AllowedTokenPool(vocab_size, self.device)
        # NOTE: the window holds a sequence's prefix at most: every bad word's tokens but the last.
        self.recent = RecentTokenPool(MAX_BAD_WORD_TOKENS - 1, self.device)
        self.version = 0  # bumped whenever a row changes: cached compositions are then stale
        # NOTE: several compositions of one batch alternate under speculative decoding (a verify
        # step repeats a row once per draft, and the draft count varies), so a few are kept.
        self._compositions: dict[bytes, _Composition] = {}
        self._compositions_version = 0

    # ---- rows ---------------------------------------------------------------------------------
    def add_row(self, row: int, params: SamplingParams, seed: int, eos_token_ids: Sequence[int],
                prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """Fill `row` for a request (output_token_ids: what it generated before, on a resume)."""
        p, vocab = params, self.vocab_size
        greedy = p.temperature < _GREEDY_TEMPERATURE
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else p.temperature
        self.top_k[row] = 1 if greedy else min(p.top_k, vocab)
        self.top_p[row] = 1.0 if greedy else p.top_p
        self.min_p[row] = 0.0 if greedy else p.min_p
        self.presence[row], self.frequency[row] = p.presence_penalty, p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        self.seed[row] = seed_to_int64(seed)
        self.min_tokens[row] = p.min_tokens
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        has_penalty = (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                       or p.frequency_penalty != 0.0)
        self.penalty_slot[row] = (self.penalties.acquire(prompt_token_ids, output_token_ids)
                                  if has_penalty else -1)
        bans = None
        if p.min_tokens > 0:
            banned = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                banned.update(eos_token_ids)
            bans = np.array(sorted(t for t in banned if 0 <= t < vocab), dtype=np.int64)
        self.bans[row] = bans
        bias = {t: v for t, v in (p.logit_bias or {}).items() if 0 <= t < vocab}
        self.bias[row] = ((np.fromiter(bias.keys(), np.int64, len(bias)),
                           np.fromiter(bias.values(), np.float32, len(bias))) if bias else None)
        self.has_bias[row] = bool(bias)
        self.allowed_slot[row] = (self.allowed.acquire(p.allowed_token_ids)
                                  if p.allowed_token_ids else -1)
        seqs = self._bad_word_sequences(p)
        self.bad_words[row] = seqs
        self.recent_slot[row] = self.recent.acquire(output_token_ids) if seqs else -1
        self.version += 1

    def _bad_word_sequences(self, p: SamplingParams) -> tuple[np.ndarray, np.ndarray, int] | None:
        """The bad words' token sequences that lie in the vocabulary (others can never appear), as
        right-aligned prefixes and last tokens."""
        if not p.bad_words:
            return None
        seqs = p._bad_words_token_ids
        if seqs is None:
            raise ValueError("bad_words reached the sampler untokenized: the front end fills "
                             "their token sequences (SamplingParams.with_bad_word_tokens)")
        width = self.recent.width
        if any(not q or len(q) > width + 1 for q in seqs):
            raise ValueError(f"bad word token sequences must hold 1 to {width + 1} tokens")
        seqs = [q for q in seqs if max(q) < self.vocab_size]
        if not seqs:
            return None
        prefixes = np.full((len(seqs), width), -1, np.int64)  # (n, W)
        for i, q in enumerate(seqs):
            prefixes[i, width - len(q) + 1:] = q[:-1]
        last = np.array([q[-1] for q in seqs], np.int64)  # (n,)
        return prefixes, last, max(len(q) for q in seqs) - 1

    def remove_row(self, row: int) -> None:
        """Forget `row` (its penalty slot is freed)."""
        if self.penalty_slot[row] >= 0:
            self.penalties.release(int(self.penalty_slot[row]))
        if self.allowed_slot[row] >= 0:
            self.allowed.release(int(self.allowed_slot[row]))
        if self.recent_slot[row] >= 0:
            self.recent.release(int(self.recent_slot[row]))
        self._clear(row)
        self.version += 1

    def move_row(self, src: int, dst: int) -> None:
        """Move the settings of `src` to the empty row `dst` (the device slots go with them)."""
        for name in self._ARRAYS:
            arr = getattr(self, name)
            arr[dst] = arr[src]
        self.bans[dst], self.bias[dst] = self.bans[src], self.bias[src]
        self.bad_words[dst] = self.bad_words[src]
        self._clear(src)
        self.version += 1

    def _clear(self, row: int) -> None:
        self.penalty_slot[row] = self.allowed_slot[row] = self.recent_slot[row] = -1
        self.has_bias[row] = False
        self.bans[row] = self.bias[row] = self.bad_words[row] = None

    # ---- one step -----------------------------------------------------------------------------
    def metadata(self, rows: np.ndarray, steps: np.ndarray) -> SamplingMetadata:
        """The metadata of a step sampling `rows` (logits row b = rows[b]) at token index `steps`.

        steps[b]: the number of output tokens before the one sampled now (keys the random stream
        and min_tokens).
        """
        rows = np.asarray(rows, dtype=np.int64)
        steps = np.asarray(steps, dtype=np.int64)
        if rows.size == 0:
            raise ValueError("sampling metadata needs at least one row")
        if steps.shape != rows.shape:
            raise ValueError(f"steps has {steps.size} entries for {rows.size} rows")
        comps = self._compositions
        if self._compositions_version != self.version:
            comps.clear()
            self._compositions_version = self.version
        order = rows.tobytes()
        comp = comps.pop(order, None)
        if comp is None:
            comp = self._build_composition((self.version, order), rows)
            if len(comps) >= MAX_CACHED_COMPOSITIONS:
                del comps[next(iter(comps))]  # the least recently used
        comps[order] = comp  # most recently used last
        below = np.flatnonzero(steps[comp.min_token_rows] < comp.min_token_limits)
        if comp.meta.all_greedy and not below.size:
            # NOTE: only random draws read the steps (their noise's key): nothing to send.
            return dataclasses.replace(comp.meta)
        arrays = [steps]
        if below.size:
            bans = [comp.min_token_bans[i] for i in below]
            ban_rows = np.repeat(comp.min_token_rows[below], [b.size for b in bans])
            arrays.append(np.stack([ban_rows, np.concatenate(bans)]))  # (2, N)
        dev = upload(arrays, self.device)
        meta = dataclasses.replace(comp.meta, steps=dev[0])
        if below.size and dev[1].shape[1]:
            meta.any_min_tokens = True
            meta.banned_rows, meta.banned_tokens = dev[1][0], dev[1][1]
        return meta

    def add_grammar_masks(self, meta: SamplingMetadata, rows: np.ndarray, bitmask: np.ndarray) -> None:
        """Constrain logits rows `rows` (G,) of this step's `meta` to their grammar's allowed tokens,
        bitmask (G, ceil(V / 32)) int32 (bit t of a row allows token t)."""
        rows = np.asarray(rows, dtype=np.int64)
        bitmask = np.asarray(bitmask)
        if bitmask.dtype != np.int32 or bitmask.shape != (rows.size, -(-self.vocab_size // 32)):
            raise ValueError(f"the grammar bitmask must be int32 of shape ({rows.size}, "
                             f"{-(-self.vocab_size // 32)}), got {bitmask.dtype} {bitmask.shape}")
        if rows.size == 0:
            return
        meta.grammar_rows, meta.grammar_bitmask = upload([rows, bitmask], self.device)
        meta.any_grammar = True

    def record_sampled(self, meta: SamplingMetadata, sampled: torch.Tensor) -> None:
        """Count the step's sampled tokens (B,) into the penalty rows' output counts and shift them
        into the bad-word rows' recent-token windows, on the device."""
        if meta.penalty_rows is not None:
            self.penalties.record(meta.penalty_slots, sampled.index_select(0, meta.penalty_rows))
        if meta.recent_rows is not None:
            self.recent.record(meta.recent_slots, sampled.index_select(0, meta.recent_rows))

    def _build_composition(self, key: tuple[int, bytes], rows: np.ndarray) -> _Composition:
        greedy = self.greedy[rows]  # (B,)
        sampled = ~greedy
        top_k = self.top_k[rows]  # (B,)
        sampled_top_k = top_k[sampled]
        slots = self.penalty_slot[rows]  # (B,)
        pen = np.flatnonzero(slots >= 0)  # (P,)
        pen_src = rows[pen]
        biased = np.flatnonzero(self.has_bias[rows])  # (M rows,)
        arrays = [np.stack([top_k, self.seed[rows]]),
                  np.stack([self.temperature[rows], self.top_p[rows], self.min_p[rows]]),
                  greedy,
                  np.stack([pen, slots[pen]]),
                  np.stack([self.presence[pen_src], self.frequency[pen_src],
                            self.repetition[pen_src]])]
        if biased.size:
            parts = [self.bias[r] for r in rows[biased]]
            counts = [t.size for t, _ in parts]
            arrays.append(np.stack([np.repeat(biased, counts), np.concatenate([t for t, _ in parts])]))
            arrays.append(np.concatenate([v for _, v in parts]))
        n_fixed = len(arrays)
        allowed = np.flatnonzero(self.allowed_slot[rows] >= 0)  # (A,)
        if allowed.size:
            arrays.append(np.stack([allowed, self.allowed_slot[rows[allowed]]]))
        bad = np.flatnonzero(self.recent_slot[rows] >= 0)  # (R,)
        if bad.size:
            arrays.extend(self._bad_word_arrays(rows, bad))
        dev = upload(arrays, self.device)
        logprobs = self.num_logprobs[rows]
        meta = SamplingMetadata(
            temperature=dev[1][0], greedy_mask=dev[2] if greedy.any() else None, top_k=dev[0][0],
            top_p=dev[1][1], min_p=dev[1][2], seeds=dev[0][1],
            steps=None,  # set per step
            all_greedy=not sampled.any(),
            any_top_k=bool((sampled_top_k > 0).any()),
            all_top_k=bool(sampled.any() and (sampled_top_k > 0).all()),
            max_top_k=int(sampled_top_k.max(initial=0)),
            any_top_p=bool((self.top_p[rows][sampled] < 1.0).any()),
            any_min_p=bool((self.min_p[rows][sampled] > 0.0).any()),
            max_num_logprobs=int(logprobs.max()) if (logprobs >= 0).any() else None)
        if pen.size:
            meta.any_penalties = True
            meta.any_repetition_penalty = bool((self.repetition[pen_src] != 1.0).any())
            meta.any_presence_frequency = bool(((self.presence[pen_src] != 0.0)
                                                | (self.frequency[pen_src] != 0.0)).any())
            meta.penalty_rows, meta.penalty_slots = dev[3][0], dev[3][1]
            meta.presence_penalties, meta.frequency_penalties, meta.repetition_penalties = dev[4]
            meta.prompt_token_mask = self.penalties.prompt_mask
            meta.output_token_counts = self.penalties.counts
        if biased.size and dev[6].numel():
            meta.any_logit_bias = True
            meta.bias_rows, meta.bias_tokens, meta.bias_values = dev[5][0], dev[5][1], dev[6]
        extra = iter(dev[n_fixed:])
        if allowed.size:
            meta.any_allowed_tokens = True
            meta.allowed_rows, meta.allowed_slots = next(extra)
            meta.allowed_mask = self.allowed.mask
        if bad.size:
            meta.any_bad_words = True
            meta.recent_rows, meta.recent_slots = next(extra)
            (meta.bad_word_rows, meta.bad_word_slots, meta.bad_word_last) = next(extra)
            meta.bad_word_prefixes = next(extra)
            meta.recent_tokens = self.recent.tokens
        mt = np.flatnonzero(self.min_tokens[rows] > 0)
        return _Composition(key, meta, mt, self.min_tokens[rows[mt]],
                            [self.bans[r] for r in rows[mt]])


    def _bad_word_arrays(self, rows: np.ndarray, bad: np.ndarray) -> list[np.ndarray]:
        """(2, R) rows and window slots; (3, Q) row, slot and last token per sequence; (Q, K)
        prefixes, K the longest prefix in the batch."""
        slots = self.recent_slot[rows[bad]]  # (R,)
        parts = [self.bad_words[r] for r in rows[bad]]
        counts = [last.size for _, last, _ in parts]
        k = max(n for _, _, n in parts)
        prefixes = np.concatenate([pre for pre, _, _ in parts])[:, self.recent.width - k:]  # (Q, K)
        per_seq = np.stack([np.repeat(bad, counts), np.repeat(slots, counts),
                            np.concatenate([last for _, last, _ in parts])])  # (3, Q)
        return [np.stack([bad, slots]), per_seq, np.ascontiguousarray(prefixes)]


def build_sampling_metadata(requests: Sequence, vocab_size: int, device: torch.device | str,
                            steps: Sequence[int] | None = None) -> SamplingMetadata:
    """One-off metadata for request-like objects (row b = requests[b]), through `SamplingRows`.

    Each object has sampling_params, seed, eos_token_ids, prompt_token_ids and output_token_ids.
    steps: per row, the number of output tokens before the one sampled now (default: the length of
    output_token_ids).
    """
    if not requests:
        raise ValueError("build_sampling_metadata needs at least one request")
    if steps is None:
        steps = [len(r.output_token_ids) for r in requests]
    elif len(steps) != len(requests):
        raise ValueError(f"steps has {len(steps)} entries for {len(requests)} requests")
    rows = SamplingRows(len(requests), vocab_size, device)
    for i, r in enumerate(requests):
        rows.add_row(i, r.sampling_params, r.seed, r.eos_token_ids, r.prompt_token_ids,
                     r.output_token_ids)
    return rows.metadata(np.arange(len(requests)), np.asarray(steps, dtype=np.int64))
