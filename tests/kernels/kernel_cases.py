"""Random paged-attention inputs shared by the kernel tests."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch


class PagedCase(NamedTuple):
    q: torch.Tensor  # (T, Hq, D)
    k_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D)
    block_table: torch.Tensor  # (B, width) int32
    seq_lens: torch.Tensor  # (B,) int32
    query_start_loc: torch.Tensor  # (B + 1,) int32
    max_query_len: int


def make_paged_case(seq_lens: list[int], q_lens: list[int], num_q_heads: int, num_kv_heads: int,
                    head_dim: int = 64, block_size: int = 16, dtype: torch.dtype = torch.float32,
                    extra_width: int = 2, seed: int = 0) -> PagedCase:
    """Shuffled physical blocks, a block table wider than needed, and garbage in unused blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_per_seq) + extra_width
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    # NOTE: unused table entries point past the cache, so reading one would fault or misbehave.
    block_table = torch.full((len(seq_lens), width), num_blocks + 1000, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        block_table[i, :nb] = perm[used:used + nb]
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(qsl[-1]), num_q_heads, head_dim, generator=gen).to(dtype)
    return PagedCase(q, k_cache, v_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32),
                     qsl, max(q_lens))


def exact_reference(case: PagedCase, scale: float, window: int | None = None) -> torch.Tensor:
    """The fp32 reference on the (already rounded) inputs, so low-precision kernels compare to
    the exact answer rather than to another rounded one."""
    from peregrine.kernels.reference import paged_attention_ref
    return paged_attention_ref(case.q.float(), case.k_cache.float(), case.v_cache.float(),
                               case.block_table, case.seq_lens, case.query_start_loc, scale,
                               window=window)


# Tolerances for comparing a kernel's output (cast to fp32) with the exact fp32 reference.
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5),
              torch.bfloat16: dict(atol=2e-2, rtol=1e-2),  # ~1-2 bf16 ulps at |x| <= 2
              torch.float16: dict(atol=2e-3, rtol=2e-3)}


FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
# The same two for the widest parametrizations: e5m2 in the full suite only (the fast tier
# keeps e4m3, the format the engine's FP8 cache uses)
FP8_E5M2_SLOW = [pytest.param(torch.float8_e4m3fn, id="e4m3"),
                 pytest.param(torch.float8_e5m2, id="e5m2", marks=pytest.mark.slow)]
# Scales that are not powers of two, so a wrong fold (divide vs multiply, K vs V) shows.
K_SCALE, V_SCALE = 0.37, 0.11


def fp8_case(case: PagedCase, cache_dtype: torch.dtype, k_scale: float = K_SCALE,
             v_scale: float = V_SCALE) -> tuple[PagedCase, PagedCase]:
    """(case with its caches quantized to cache_dtype as k / k_scale, v / v_scale; the same case
    with those caches dequantized to fp32: what the FP8 kernels must compute on exactly)."""
    from peregrine.kernels.reference import dequantize_kv_ref, quantize_kv_ref
    kq = quantize_kv_ref(case.k_cache, cache_dtype, k_scale)
    vq = quantize_kv_ref(case.v_cache, cache_dtype, v_scale)
    deq = case._replace(k_cache=dequantize_kv_ref(kq, k_scale),
                        v_cache=dequantize_kv_ref(vq, v_scale))
    return case._replace(k_cache=kq, v_cache=vq), deq


def fp8_error_bounds(cache_dtype: torch.dtype, v: torch.Tensor) -> tuple[float, float]:
    """(max, mean) absolute error allowed between attention on an FP8 cache and on the exact
    one. Each output is a convex combination of V rows, and rounding V to FP8 moves each value
    by at most half an ulp, 2^-(M+1) relative (M mantissa bits); rounding K moves the weights
    a little more. Measured on randn K/V: max ~0.4x, mean ~0.25x of these."""
    half_ulp = 2.0 ** -(4 if cache_dtype == torch.float8_e4m3fn else 3)
    va = v.float().abs()
    return half_ulp * va.max().item(), half_ulp * va.mean().item() / 2
