"""Batched sampler on the logits' device: penalties, temperature, top-k/top-p/min-p, seeded draws.

Stage order: structured-output grammar mask -> allowed_token_ids -> bad_words -> logit_bias -> min_tokens -> repetition penalty ->
presence/frequency penalties -> (greedy rows: argmax) -> temperature -> top-k -> top-p -> min-p ->
draw. No host<->device syncs and no loops over rows.

Filtering keeps, per row, every token whose tempered logit is >= one threshold (the largest of the top-k,
top-p and min-p cut-offs). The kept set is therefore a function of the values alone, whichever code path
(full sort, top-k over the vocab, or the compact top-k path) computed the threshold.

Draws use the exponential race: with E_v ~ Exp(1) i.i.d., argmax_v p_v / E_v is exactly distributed as p,
because E_v / p_v ~ Exp(rate p_v) and the smallest of independent exponentials is the one of index v with
probability p_v / sum(p). In log space that is argmax_v (logit_v / T - log E_v) (the Gumbel-max trick), so
no softmax is needed and filtered tokens (-inf) can never win. E_v = -log(u_v) with u_v a hash of
(seed, step, v) (noise.py): the same request gets the same noise wherever it sits in whatever batch.

Two implementations of the full-vocabulary draw: pure torch (the reference; CPU default) and, on CUDA, one
Triton pass (peregrine/kernels/sampling.py) that reads the logits once and does temperature, noise, the
threshold mask and the argmax together, with no (B, V) temporaries. Both pick the same token: thresholds
come from the same torch code, and the kernel repeats the noise's integer and float steps exactly.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from peregrine import envs

from peregrine.sample.constraints import apply_allowed_tokens, apply_bad_words, apply_token_bitmask
from peregrine.sample.logprobs import compute_token_logprobs
from peregrine.sample.metadata import SamplingMetadata
from peregrine.sample.noise import as_int32_bits, log_exponentials, row_keys, token_hashes

_NEG_INF = float("-inf")


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # (B,) int64
    logprob_token_ids: torch.Tensor | None  # (B, K+1) int64: sampled token, then the top-K
    logprobs: torch.Tensor | None  # (B, K+1) float32, of the raw (unpenalised, untempered) distribution
    ranks: torch.Tensor | None  # (B,) int64: rank of the sampled token in the raw distribution
    # (B, V) float32: the distribution each row was drawn from (after penalties, temperature and
    # the top-k/top-p/min-p filter; one-hot on greedy rows). Only with return_probs=True.
    probs: torch.Tensor | None = None


def _filter_thresholds(vals: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Per-row keep threshold from `vals` (B, K) sorted descending: top-k, then top-p, then min-p."""
    k = meta.top_k.clamp(max=vals.shape[-1])  # (B,)
    kth = vals.gather(-1, (k - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B,)
    thr = torch.where(k > 0, kth, _NEG_INF)  # (B,)
    if meta.any_top_p:
        # NOTE: the caller guarantees `vals` covers every token top-k kept, so this softmax is the
        # renormalised top-k distribution and top-p is exact.
        probs = vals.masked_fill(vals < thr.unsqueeze(-1), _NEG_INF).softmax(dim=-1)  # (B, K)
        cum = probs.cumsum_(dim=-1)  # (B, K)
        # Smallest prefix whose mass reaches top_p: all positions still below it, plus the one crossing it.
        n_keep = ((cum < meta.top_p.unsqueeze(-1)).sum(-1) + 1).clamp(max=vals.shape[-1])  # (B,)
        thr_p = vals.gather(-1, (n_keep - 1).unsqueeze(-1)).squeeze(-1)  # (B,)
        # NOTE: rows with top_p == 1 keep everything, even tokens a float32 cumsum would call beyond 1.
        thr = torch.maximum(thr, torch.where(meta.top_p < 1.0, thr_p, _NEG_INF))
    if meta.any_min_p:
        # p_v >= min_p * p_max  <=>  logit_v >= logit_max + log(min_p); log(0) = -inf disables the row.
        thr = torch.maximum(thr, vals[:, 0] + meta.min_p.log())
    return thr


def _kernel_usable_on_cpu() -> bool:
    return envs.triton_interpret()


class Sampler:
    """Turns (B, V) logits into one token per row according to each row's SamplingParams."""

    # top-k up to this (when every sampled row has one) works on torch.topk's (B, k) output;
    # larger k, or top-p without top-k somewhere in the batch, sorts the whole vocabulary.
    max_compact_top_k: int = 256

    def __init__(self, use_kernel: bool | None = None) -> None:
        """use_kernel: None = fused Triton draw on CUDA, pure torch elsewhere; True/False force one."""
        # NOTE: True on a CPU tensor runs the Triton interpreter: TRITON_INTERPRET=1 must be set before
        # peregrine.kernels.sampling is first imported.
        self.use_kernel = use_kernel
        self._token_hash_cache: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 return_probs: bool = False) -> SamplerOutput:
        """Sample one token per row; `logits` is not modified.

        return_probs: also return the (B, V) distribution each row was sampled from.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be (B, V), got shape {tuple(logits.shape)}")
        if self._uses_kernel(logits):
            x, sampled = self._sample_fused(logits, meta)
            raw = logits  # compute_token_logprobs upcasts by itself
        else:
            raw = logits if logits.dtype == torch.float32 else logits.float()  # (B, V)
            x = self.apply_penalties(raw, meta)  # (B, V)
            greedy = x.argmax(dim=-1) if meta.greedy_mask is not None else None  # (B,)
            if meta.all_greedy:
                sampled = greedy
            else:
                sampled = self._sample(x, meta)  # (B,)
                if greedy is not None:
                    sampled = torch.where(meta.greedy_mask, greedy, sampled)
        probs = self._probs(x, meta, sampled) if return_probs else None
        if meta.max_num_logprobs is None:
            return SamplerOutput(sampled, None, None, None, probs)
        lp = compute_token_logprobs(raw, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, lp.token_ids, lp.logprobs, lp.ranks, probs)

    def warm_up(self, vocab_size: int, device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
        """Compile the fused kernel's variants (with and without a threshold) before the first step."""
        device = torch.device(device)
        if not self._uses_kernel(torch.empty(0, device=device)):
            return
        from peregrine.kernels.sampling import argmax_rows, gumbel_argmax

        logits = torch.zeros(1, vocab_size, dtype=dtype, device=device)  # (1, V)
        ones, zeros = torch.ones(1, device=device), torch.zeros(1, dtype=torch.int64, device=device)
        table = self._token_hash_table(vocab_size, device, torch.int32)  # (V,)
        for thr in (None, torch.zeros(1, device=device)):
            gumbel_argmax(logits, ones, zeros, zeros, table, thr)
        argmax_rows(logits)

    def _uses_kernel(self, logits: torch.Tensor) -> bool:
        if self.use_kernel is None:
            return logits.device.type == "cuda"
        if self.use_kernel and logits.device.type != "cuda" and not _kernel_usable_on_cpu():
            raise ValueError("Sampler(use_kernel=True) on a CPU tensor needs TRITON_INTERPRET=1")
        return self.use_kernel

    @staticmethod
    def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Grammar masks, allowed_token_ids and bad_words bans, logit_bias, min_tokens bans, then repetition,
        presence and frequency penalties; returns a new tensor if any."""
        if not meta.changes_logits:
            return logits
        x = logits.clone()  # (B, V)
        if meta.any_grammar:
            apply_token_bitmask(x, meta.grammar_rows, meta.grammar_bitmask)
        if meta.any_allowed_tokens:
            apply_allowed_tokens(x, meta.allowed_rows, meta.allowed_slots, meta.allowed_mask)
        if meta.any_bad_words:
            apply_bad_words(x, meta.bad_word_rows, meta.bad_word_slots, meta.bad_word_prefixes,
                            meta.bad_word_last, meta.recent_tokens)
        if meta.any_logit_bias:
            x.index_put_((meta.bias_rows, meta.bias_tokens), meta.bias_values, accumulate=True)
        if meta.any_min_tokens:
            x.index_put_((meta.banned_rows, meta.banned_tokens), x.new_full((), _NEG_INF))
        if not meta.any_penalties:
            return x
        # NOTE: only the P rows with penalties are gathered; their state lives in persistent pools.
        rows, slots = meta.penalty_rows, meta.penalty_slots  # (P,), (P,)
        y = x.index_select(0, rows)  # (P, V)
        counts = meta.output_token_counts.index_select(0, slots)  # (P, V) int32
        if meta.any_repetition_penalty:
            seen = meta.prompt_token_mask.index_select(0, slots) | (counts > 0)  # (P, V)
            r = meta.repetition_penalties.unsqueeze(-1)  # (P, 1)
            y = torch.where(seen, torch.where(y > 0, y / r, y * r), y)
        if meta.any_presence_frequency:
            y -= meta.frequency_penalties.unsqueeze(-1) * counts
            y -= meta.presence_penalties.unsqueeze(-1) * (counts > 0)
        return x.index_copy_(0, rows, y)

    def _probs(self, x: torch.Tensor, meta: SamplingMetadata, sampled: torch.Tensor) -> torch.Tensor:
        """(B, V) float32: softmax of the tempered logits `x` over each row's kept tokens; one-hot
        rows for greedy rows."""
        x = x.float()  # (B, V)
        onehot = torch.zeros_like(x).scatter_(-1, sampled.unsqueeze(-1), 1.0)  # (B, V)
        if meta.all_greedy:
            return onehot
        thr = self._threshold(x, meta)  # (B,) or None
        xt = x / meta.temperature.unsqueeze(-1)  # (B, V)
        if thr is not None:
            # NOTE: the same keep test as the draw (tokens below the threshold never win).
            xt.masked_fill_(xt < thr.unsqueeze(-1), _NEG_INF)
        probs = xt.softmax(dim=-1)  # (B, V)
        if meta.greedy_mask is not None:
            probs = torch.where(meta.greedy_mask.unsqueeze(-1), onehot, probs)
        return probs

    def _token_hash_table(self, vocab: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """(V,) token hashes: int64 for the torch path, int32 bits for the kernel; built once per device."""
        key = (vocab, device, dtype)
        table = self._token_hash_cache.get(key)
        if table is None:
            table = token_hashes(torch.arange(vocab, device=device))  # (V,)
            if dtype == torch.int32:
                table = as_int32_bits(table)
            self._token_hash_cache[key] = table
        return table

    def _is_compact(self, meta: SamplingMetadata) -> bool:
        return meta.all_top_k and meta.max_top_k <= self.max_compact_top_k

    def _threshold(self, x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor | None:
        """(B,) keep threshold on the tempered logits, from untempered `x`; None: keep everything."""
        # NOTE: dividing by T > 0 with exact rounding is monotone, so sorted(x) / T equals sorted(x / T)
        # value for value: thresholds come out bit-identical without a tempered (B, V) copy of x.
        temp = meta.temperature.unsqueeze(-1)  # (B, 1)
        if meta.any_top_p or (meta.any_top_k and meta.max_top_k > self.max_compact_top_k):
            return _filter_thresholds(x.sort(dim=-1, descending=True).values.float().div_(temp), meta)
        if meta.any_top_k:
            # top-k without top-p: the k-th largest value is all we need (rows without top-k get -inf).
            return _filter_thresholds(x.topk(meta.max_top_k, dim=-1).values.float().div_(temp), meta)
        if meta.any_min_p:
            return x.amax(dim=-1).float().div_(meta.temperature).add_(meta.min_p.log())  # (B,)
        return None

    def _sample_compact(self, x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Every sampled row keeps at most max_top_k tokens: filter and draw on (B, K) only."""
        vals, ids = x.topk(meta.max_top_k, dim=-1)  # (B, K), (B, K)
        vals = vals / meta.temperature.unsqueeze(-1)  # (B, K)
        thr = _filter_thresholds(vals, meta)  # (B,)
        keys = row_keys(meta.seeds, meta.steps).unsqueeze(-1)  # (B, 1)
        table = self._token_hash_table(x.shape[-1], x.device, torch.int64)  # (V,)
        scores = vals - log_exponentials(keys, table[ids])  # (B, K)
        scores.masked_fill_(vals < thr.unsqueeze(-1), _NEG_INF)
        return ids.gather(-1, scores.argmax(dim=-1, keepdim=True)).squeeze(-1)

    def _sample(self, x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The pure-torch draw on penalised float32 logits (the reference for the kernel)."""
        if self._is_compact(meta):
            return self._sample_compact(x, meta)
        thr = self._threshold(x, meta)  # (B,) or None
        keys = row_keys(meta.seeds, meta.steps).unsqueeze(-1)  # (B, 1)
        table = self._token_hash_table(x.shape[-1], x.device, torch.int64)  # (V,)
        x = x / meta.temperature.unsqueeze(-1)  # (B, V)
        log_e = log_exponentials(keys, table.unsqueeze(0))  # (B, V)
        scores = torch.sub(x, log_e, out=log_e)  # (B, V)
        if thr is not None:
            scores.masked_fill_(x < thr.unsqueeze(-1), _NEG_INF)
        return scores.argmax(dim=-1)

    def _sample_fused(self, logits: torch.Tensor, meta: SamplingMetadata
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(penalised logits, tokens): the torch path's tokens; noise, temperature, mask and argmax
        in one Triton pass."""
        # NOTE: imported here: triton.jit reads TRITON_INTERPRET when the kernel module is imported.
        from peregrine.kernels.sampling import argmax_rows, gumbel_argmax

        x = logits  # (B, V), any float dtype: the kernel upcasts as it loads
        if meta.changes_logits:
            x = self.apply_penalties(logits.float(), meta)  # (B, V) float32
        if meta.all_greedy:
            return x, argmax_rows(x)
        if self._is_compact(meta):
            sampled = self._sample_compact(x.float(), meta)  # (B,)
            if meta.greedy_mask is not None:
                sampled = torch.where(meta.greedy_mask, argmax_rows(x), sampled)
            return x, sampled
        thr = self._threshold(x, meta)  # (B,) or None
        temp = meta.temperature  # (B,)
        if meta.greedy_mask is not None:
            temp = temp.masked_fill(meta.greedy_mask, 0.0)  # the kernel's marker for an argmax row
        table = self._token_hash_table(x.shape[-1], x.device, torch.int32)  # (V,)
        return x, gumbel_argmax(x, temp, meta.seeds, meta.steps, table, thr)
