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


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
def test_store_kv_fp8_round_trip_equals_reference_quantize(cache_dtype: torch.dtype,
                                                           src_dtype: torch.dtype) -> None:
    from peregrine.kernels.reference import dequantize_kv_ref, quantize_kv_ref
    gen = torch.Generator().manual_seed(3)
    num_tokens, heads, dim = 40, 2, 64
    # Magnitudes from FP8 subnormals to far past the largest finite value (saturation).
    spread = torch.logspace(-8, 6, num_tokens)[:, None, None]  # (T, 1, 1)
    k = (torch.randn(num_tokens, heads, dim, generator=gen) * spread).to(src_dtype)
    v = (torch.randn(num_tokens, heads, dim, generator=gen) * spread.flip(0)).to(src_dtype)
    k_cache = torch.zeros(4, 16, heads, dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(64, generator=gen)[:num_tokens]
    slots[7] = -1
    k_scale, v_scale = 0.37, 3.1
    store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    valid = slots >= 0
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        stored = cache.flatten(0, 1)[slots[valid]]  # (n, Hkv, D)
        want = quantize_kv_ref(x[valid], cache_dtype, scale)
        assert torch.equal(_bits(stored), _bits(want))
        assert torch.equal(dequantize_kv_ref(stored, scale), want.float() * scale)
        assert torch.isfinite(stored.float()).all()  # saturated, never inf/NaN
        assert stored.float().abs().max().item() == torch.finfo(cache_dtype).max
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv_ref(k, v, k_ref, v_ref, slots, k_scale, v_scale)
    assert torch.equal(_bits(k_cache), _bits(k_ref)) and torch.equal(_bits(v_cache), _bits(v_ref))


@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
def test_store_kv_fp8_rounds_every_value_and_tie_like_torch(cache_dtype: torch.dtype) -> None:
    """Every finite FP8 value, the midpoints between neighbours (ties go to the even one) and
    points just either side of them, signed, and a NaN that stays NaN."""
    finite = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
    finite = finite[torch.isfinite(finite)].unique()  # sorted
    mids = (finite[1:] + finite[:-1]) / 2  # exact in fp32
    near = torch.cat([mids, torch.nextafter(mids, finite[1:]), torch.nextafter(mids, finite[:-1])])
    x = torch.cat([finite, near, torch.tensor([1e30, -1e30, 0.0, -0.0])])
    pad = (-x.numel()) % 64
    x = torch.cat([x, torch.zeros(pad)]).view(-1, 1, 64)  # (T, 1, 64)
    num_tokens = x.shape[0]
    k_cache = torch.zeros(num_tokens, 1, 1, 64, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    v = x.clone()
    v[0, 0, 0] = float("nan")
    slots = torch.arange(num_tokens)
    store_kv(x, v, k_cache, v_cache, slots)
    fmax = torch.finfo(cache_dtype).max
    want = x.clamp(-fmax, fmax).to(cache_dtype)  # torch rounds to nearest even
    assert torch.equal(_bits(k_cache).flatten(), _bits(want).flatten())
    assert torch.isnan(v_cache[0, 0, 0, 0].float())
    assert torch.equal(_bits(v_cache).flatten()[1:], _bits(k_cache).flatten()[1:])


def test_store_kv_16_bit_cache_applies_scales() -> None:
    k, v, k_cache, v_cache, slots = _inputs(torch.float32, 16)
    store_kv(k, v, k_cache, v_cache, slots, 2.0, 0.5)
    valid = slots >= 0
    assert torch.equal(k_cache.flatten(0, 1)[slots[valid]], k[valid] / 2.0)
    assert torch.equal(v_cache.flatten(0, 1)[slots[valid]], v[valid] / 0.5)


def test_store_kv_rejects_bad_scales_and_mixed_caches() -> None:
    k, v, k_cache, v_cache, slots = _inputs(torch.float32, 16)
    with pytest.raises(ValueError, match="k_scale and v_scale must be > 0"):
        store_kv(k, v, k_cache, v_cache, slots, 0.0, 1.0)
    with pytest.raises(ValueError, match="differ"):
        store_kv(k, v, k_cache, v_cache.to(torch.float8_e4m3fn), slots)
