from __future__ import annotations

import pytest
import torch

from peregrine.kernels.reference import store_kv_ref
from peregrine.kernels.store_kv import store_kv


def _inputs(dtype: torch.dtype, block_size: int, num_kv_heads: int = 2, head_dim: int = 64):
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_blocks = 7, 6
    # NOTE: k/v are views into a fused qkv projection, as the model produces them.
    qkv = torch.randn(num_tokens, 4 + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    k, v = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]  # (T, Hkv, D) each
    cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[2] = -1
    slots[5] = -1
    return k, v, cache, cache.clone() + 1, slots.to(torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_store_kv_matches_reference(dtype: torch.dtype, block_size: int) -> None:
    k, v, k_cache, v_cache, slots = _inputs(dtype, block_size)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_store_kv_writes_exactly_the_valid_slots() -> None:
    k, v, k_cache, v_cache, slots = _inputs(torch.float32, 16)
    before = k_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    flat, flat_before = k_cache.flatten(0, 1), before.flatten(0, 1)  # (slots, Hkv, D)
    valid = slots >= 0
    assert torch.equal(flat[slots[valid]], k[valid])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[valid]] = False
    assert torch.equal(flat[untouched], flat_before[untouched])


def test_store_kv_rejects_non_power_of_two_block_size() -> None:
    k, v, _, _, slots = _inputs(torch.float32, 16)
    cache = torch.zeros(4, 12, 2, 64)
    with pytest.raises(ValueError, match="power of two"):
        store_kv(k, v, cache, cache.clone(), slots)
