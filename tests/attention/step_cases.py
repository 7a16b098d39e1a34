"""Random step batches (decodes first, prefill chunks after cached prefixes) plus their dense
un-paged K/V, for checking attention backends against a naive oracle."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from peregrine.attention.metadata import AttentionMetadata


@dataclass
class Step:
    q: torch.Tensor  # (T, Hq, D), T includes padding tokens
    k: torch.Tensor  # (T, Hkv, D) new tokens
    v: torch.Tensor  # (T, Hkv, D)
    k_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D), prefixes already stored
    v_cache: torch.Tensor
    meta: AttentionMetadata
    dense_k: list[torch.Tensor]  # per sequence (seq_len, Hkv, D): prefix + new tokens
    dense_v: list[torch.Tensor]
    expected_k_cache: torch.Tensor  # the cache once the new tokens are stored
    expected_v_cache: torch.Tensor


def make_step(prefix_lens: list[int], q_lens: list[int], num_q_heads: int = 4,
              num_kv_heads: int = 2, head_dim: int = 64, block_size: int = 16,
              dtype: torch.dtype = torch.float32, num_pad_tokens: int = 0,
              seed: int = 0) -> Step:
    """Sequences must be ordered decodes (q_len 1) first; padding tokens go at the end."""
    gen = torch.Generator().manual_seed(seed)
    num_decodes = 0
    while num_decodes < len(q_lens) and q_lens[num_decodes] == 1:
        num_decodes += 1
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq) + 1
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)  # garbage where nothing is stored
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    dense_k, dense_v, slots, used = [], [], [], 0
    for i, (prefix, seq_len) in enumerate(zip(prefix_lens, seq_lens)):
        blocks = perm[used:used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        block_table[i, :len(blocks)] = blocks.to(torch.int32)
        pos = torch.arange(seq_len)
        seq_slots = blocks[pos // block_size] * block_size + pos % block_size  # (L,)
        kd = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        vd = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        for cache, exp, dense in ((k_cache, exp_k, kd), (v_cache, exp_v, vd)):
            cache.view(-1, num_kv_heads, head_dim)[seq_slots[:prefix]] = dense[:prefix]
            exp.view(-1, num_kv_heads, head_dim)[seq_slots] = dense
        dense_k.append(kd)
        dense_v.append(vd)
        slots.append(seq_slots[prefix:])
    num_actual = sum(q_lens)
    slot_mapping = torch.cat(slots + [torch.full((num_pad_tokens,), -1)]).to(torch.int64)
    k = torch.cat([kd[p:] for kd, p in zip(dense_k, prefix_lens)]
                  + [torch.randn(num_pad_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)])
    v = torch.cat([vd[p:] for vd, p in zip(dense_v, prefix_lens)]
                  + [torch.randn(num_pad_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)])
    q = torch.randn(num_actual + num_pad_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=num_actual, num_decodes=num_decodes,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc=qsl,
        seq_lens=seq_lens_t, block_table=block_table, slot_mapping=slot_mapping,
        query_start_loc_cpu=qsl.clone(), seq_lens_cpu=seq_lens_t.clone())
    return Step(q, k, v, k_cache, v_cache, meta, dense_k, dense_v, exp_k, exp_v)


def naive_attention(step: Step, scale: float) -> torch.Tensor:
    """Dense causal attention per sequence on un-paged K/V, kv heads repeated; fp32, (n, Hq, D)."""
    outs = []
    qsl = step.meta.query_start_loc.tolist()
    for i, (kd, vd) in enumerate(zip(step.dense_k, step.dense_v)):
        q = step.q[qsl[i]:qsl[i + 1]].float()  # (n, Hq, D)
        group = q.shape[1] // kd.shape[1]
        k = kd.float().repeat_interleave(group, dim=1)  # (L, Hq, D)
        v = vd.float().repeat_interleave(group, dim=1)  # (L, Hq, D)
        n, seq_len = q.shape[0], k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # (Hq, n, L)
        q_pos = torch.arange(seq_len - n, seq_len)[:, None]  # (n, 1)
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5),
              torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}  # ~1-2 bf16 ulps at |x| <= 2
