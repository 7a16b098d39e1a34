"""Paged-attention inputs on CUDA and the error measures of the GPU kernel tests."""
from __future__ import annotations

import torch

from peregrine.kernels import reference as ref

DEV = torch.device("cuda")
# Max |kernel - fp32 reference| on the same (already rounded) inputs; attention outputs are O(1).
ATTN_TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}
# Elementwise kernels: 2 bf16 ulps of relative error (kernel and reference each round once).
ELEM_TOL = 2 ** -6
DTYPE_IDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def paged_inputs(seq_lens: list[int], q_lens: list[int], hq: int, hkv: int, head_dim: int,
                 dtype: torch.dtype, block_size: int = 16, width: int | None = None):
    """(q, k_cache, v_cache, block_table, seq_lens, query_start_loc): caches that hold exactly the
    sequences' blocks, shuffled; table entries past a sequence's blocks point at block 0."""
    nbs = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(sum(nbs), device=DEV).to(torch.int32)
    width = width or max(nbs)
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=DEV)  # (B, W)
    used = 0
    for i, nb in enumerate(nbs):
        block_table[i, :nb] = perm[used:used + nb]
        used += nb
    shape = (sum(nbs), block_size, hkv, head_dim)
    k_cache = torch.randn(shape, device=DEV, dtype=dtype)  # (N, bs, Hkv, D)
    v_cache = torch.randn(shape, device=DEV, dtype=dtype)  # (N, bs, Hkv, D)
    q = torch.randn(sum(q_lens), hq, head_dim, device=DEV, dtype=dtype)  # (T, Hq, D)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=DEV)  # (B + 1,)
    qsl[1:] = torch.tensor(q_lens, device=DEV).cumsum(0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)  # (B,)
    return q, k_cache, v_cache, block_table, lens, qsl


def decode_lens(batch: int, ctx: int) -> list[int]:
    """ctx, then lengths spread over [ctx/2, ctx], so splits end at different places per sequence."""
    gen = torch.Generator().manual_seed(batch * 7 + ctx)
    return [ctx] + torch.randint(max(1, ctx // 2), ctx + 1, (batch - 1,), generator=gen).tolist()


def attn_error(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, qsl: torch.Tensor, scale: float,
               window: int | None = None) -> float:
    """Max |out - exact| against the fp32 reference on the same inputs."""
    exact = ref.paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), block_table,
                                    seq_lens, qsl, scale, window=window)  # (T, Hq, D)
    return (out.float() - exact).abs().max().item()


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Max of |out - expected| / (|expected| + 1): relative for large values, absolute near 0."""
    return ((out.float() - expected.float()).abs() / (expected.float().abs() + 1)).max().item()
