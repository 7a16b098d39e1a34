"""Batched sampler on the logits' device: penalties, temperature, top-k/top-p/min-p, seeded draws.

Stage order: min_tokens -> repetition penalty -> presence/frequency penalties -> (greedy rows: argmax) ->
temperature -> top-k -> top-p -> min-p -> draw. No host<->device syncs and no loops over rows.

Filtering keeps, per row, every token whose tempered logit is >= one threshold (the largest of the top-k,
top-p and min-p cut-offs). The kept set is therefore a function of the values alone, whichever code path
(full sort, top-k over the vocab, or the compact top-k path) computed the threshold.

Draws use the exponential race: with E_v ~ Exp(1) i.i.d., argmax_v p_v / E_v is exactly distributed as p,
because E_v / p_v ~ Exp(rate p_v) and the smallest of independent exponentials is the one of index v with
probability p_v / sum(p). In log space that is argmax_v (logit_v / T - log E_v) (the Gumbel-max trick), so
no softmax is needed and filtered tokens (-inf) can never win. E_v = -log(u_v) with u_v a hash of
(seed, step, v): the same request gets the same noise wherever it sits in whatever batch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from peregrine.sample.logprobs import compute_token_logprobs
from peregrine.sample.metadata import SamplingMetadata

_M32 = 0xFFFFFFFF
# NOTE: multipliers < 2**31 keep every product of a 32-bit value below 2**63, so the int64 arithmetic
# never overflows (overflow of signed tensors is not something torch promises on every backend).
_MIX_C1 = 0x39BCD44B
_MIX_C2 = 0x3792B149
_SEED_SALT = 0x2545F491
_TOKEN_SALT = 0x1B873593
_NEG_INF = float("-inf")
_U_BITS = 23  # bits of each hash used for the uniform; (x + 0.5) * 2**-23 is exact in float32


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # (B,) int64
    logprob_token_ids: torch.Tensor | None  # (B, K+1) int64: sampled token, then the top-K
    logprobs: torch.Tensor | None  # (B, K+1) float32, of the raw (unpenalised, untempered) distribution
    ranks: torch.Tensor | None  # (B,) int64: rank of the sampled token in the raw distribution


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective 32-bit integer mixer, in place on an int64 tensor holding values in [0, 2**32)."""
    x.bitwise_xor_(x >> 16)
    x.mul_(_MIX_C1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MIX_C2).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16)
    return x


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """(B,) int64 32-bit keys of the random stream of each (seed, step)."""
    key = _mix32((seeds & _M32) ^ _SEED_SALT)  # (B,)
    key = _mix32(key.bitwise_xor_((seeds >> 32) & _M32))
    key = _mix32(key.bitwise_xor_(steps & _M32))
    return _mix32(key.bitwise_xor_((steps >> 32) & _M32))


def token_hashes(token_ids: torch.Tensor) -> torch.Tensor:
    """int64 32-bit hashes of token ids (a bijection on ids < 2**32)."""
    return _mix32(_mix32((token_ids.long() & _M32) ^ _TOKEN_SALT))


def log_exponentials(keys: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    """log(E) with E ~ Exp(1) for every (row, token): keys (B, 1), token_hash (1, N) or (B, N) -> (B, N)."""
    x = _mix32(keys ^ token_hash)  # (B, N) int64
    u = (x >> (32 - _U_BITS)).to(torch.float32)  # (B, N)
    # NOTE: u lies in [2**-24, 1 - 2**-24], so E = -log(u) is in [6e-8, 16.6] and log(E) is finite: a row
    # whose only kept token drew the extreme noise still picks it. The price of 23-bit uniforms: tokens
    # rarer than ~1e-7 of the top kept token are slightly under-drawn, and below ~4e-9 never drawn (the
    # same resolution as torch's float32 exponential_(), which vLLM uses).
    return u.add_(0.5).mul_(2.0 ** -_U_BITS).log_().neg_().log_()


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


class Sampler:
    """Turns (B, V) logits into one token per row according to each row's SamplingParams."""

    # top-k up to this (when every sampled row has one) works on torch.topk's (B, k) output;
    # larger k, or top-p without top-k somewhere in the batch, sorts the whole vocabulary.
    max_compact_top_k: int = 256

    def __init__(self) -> None:
        self._token_hash_cache: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row; `logits` is not modified."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be (B, V), got shape {tuple(logits.shape)}")
        raw = logits if logits.dtype == torch.float32 else logits.float()  # (B, V)
        x = self.apply_penalties(raw, meta)  # (B, V)
        greedy = x.argmax(dim=-1) if meta.greedy_mask is not None else None  # (B,)
        if meta.all_greedy:
            sampled = greedy
        else:
            sampled = self._sample(x, meta)  # (B,)
            if greedy is not None:
                sampled = torch.where(meta.greedy_mask, greedy, sampled)
        if meta.max_num_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        lp = compute_token_logprobs(raw, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, lp.token_ids, lp.logprobs, lp.ranks)

    @staticmethod
    def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """min_tokens bans, then repetition, presence and frequency penalties; returns a new tensor if any."""
        if not (meta.any_min_tokens or meta.any_penalties):
            return logits
        x = logits.clone()  # (B, V)
        if meta.any_min_tokens:
            x.index_put_((meta.banned_rows, meta.banned_tokens), x.new_full((), _NEG_INF))
        if not meta.any_penalties:
            return x
        counts = meta.output_token_counts  # (B, V) int32
        if meta.any_repetition_penalty:
            seen = meta.prompt_token_mask | (counts > 0)  # (B, V)
            r = meta.repetition_penalties.unsqueeze(-1)  # (B, 1)
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        if meta.any_presence_frequency:
            x -= meta.frequency_penalties.unsqueeze(-1) * counts
            x -= meta.presence_penalties.unsqueeze(-1) * (counts > 0)
        return x

    def _token_hash_table(self, vocab: int, device: torch.device) -> torch.Tensor:
        key = (vocab, device)
        table = self._token_hash_cache.get(key)
        if table is None:
            table = token_hashes(torch.arange(vocab, device=device))  # (V,)
            self._token_hash_cache[key] = table
        return table

    def _sample(self, x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        vocab = x.shape[-1]
        temp = meta.temperature.unsqueeze(-1)  # (B, 1)
        keys = row_keys(meta.seeds, meta.steps).unsqueeze(-1)  # (B, 1)
        table = self._token_hash_table(vocab, x.device)  # (V,)
        if meta.all_top_k and meta.max_top_k <= self.max_compact_top_k:
            # Compact path: every sampled row keeps at most max_top_k tokens, so work on (B, K) only.
            vals, ids = x.topk(meta.max_top_k, dim=-1)  # (B, K), (B, K)
            vals = vals / temp  # (B, K)
            thr = _filter_thresholds(vals, meta)  # (B,)
            scores = vals - log_exponentials(keys, table[ids])  # (B, K)
            scores.masked_fill_(vals < thr.unsqueeze(-1), _NEG_INF)
            return ids.gather(-1, scores.argmax(dim=-1, keepdim=True)).squeeze(-1)
        x = x / temp  # (B, V)
        thr = None
        if meta.any_top_p or (meta.any_top_k and meta.max_top_k > self.max_compact_top_k):
            thr = _filter_thresholds(x.sort(dim=-1, descending=True).values, meta)  # (B,)
        elif meta.any_top_k:
            # top-k without top-p: the k-th largest value is all we need (rows without top-k get -inf).
            thr = _filter_thresholds(x.topk(meta.max_top_k, dim=-1).values, meta)  # (B,)
        elif meta.any_min_p:
            thr = x.amax(dim=-1) + meta.min_p.log()  # (B,)
        log_e = log_exponentials(keys, table.unsqueeze(0))  # (B, V)
        scores = torch.sub(x, log_e, out=log_e)  # (B, V)
        if thr is not None:
            scores.masked_fill_(x < thr.unsqueeze(-1), _NEG_INF)
        return scores.argmax(dim=-1)

