"""The fused q/k norm + RoPE + K/V store kernel against the torch references it replaces."""
from __future__ import annotations

import pytest
import torch

from peregrine.kernels import rope_store
from peregrine.kernels.reference import norm_rope_store_ref
from peregrine.kernels.rope_store import norm_rope_store

# See test_elementwise.py: the interpreter truncates fp32 -> bf16, so bf16 may differ by an ulp
# per rounding (RMSNorm's two and RoPE's one).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _cos_sin_cache(max_pos: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)  # (P, D/2)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # (P, D)


def _case(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
          block_size: int = 16, cache_dtype: torch.dtype | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_blocks = 7, 5
    # NOTE: q, k, v are strided views into one qkv projection, as the layer hands them over.
    qkv = (torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen)
           * 2).to(dtype)
    q = qkv[:, :num_q_heads]
    k = qkv[:, num_q_heads:num_q_heads + num_kv_heads]
    v = qkv[:, num_q_heads + num_kv_heads:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype or dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype or dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[3] = -1  # a padding token
    positions = torch.tensor([0, 1, 5, 9, 30, 31, 63])
    weights = [(torch.rand(head_dim, generator=gen) + 0.5).to(dtype) for _ in range(2)]
    return qkv, q, k, v, positions, k_cache, v_cache, slots, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm_rope"])
@pytest.mark.parametrize("heads", [(6, 2, 128), (4, 4, 48), (8, 1, 64)],
                         ids=["gqa3_d128", "mha_d48", "mqa_d64"])
@pytest.mark.parametrize("early", [False, True], ids=["", "early"])
def test_norm_rope_store_matches_reference(dtype: torch.dtype, qk_norm: bool,
                                           heads: tuple[int, int, int], early: bool,
                                           monkeypatch) -> None:
    """early: the position, its RoPE table rows and the slot read before the dependent-launch
    wait (the form dependent launches take; the wait is a no-op here)."""
    monkeypatch.setattr(rope_store, "early_step_inputs", lambda pdl: early)
    qkv, q, k, v, pos, kc, vc, slots, (qw, kw) = _case(dtype, *heads)
    cache = _cos_sin_cache(64, heads[2])
    norm = dict(q_weight=qw, k_weight=kw, eps=1e-6) if qk_norm else {}
    kc_ref, vc_ref = kc.clone(), vc.clone()
    k_before, v_before = k.clone(), v.clone()
    q_ref = norm_rope_store_ref(q, k, v, pos, cache, kc_ref, vc_ref, slots, **norm)
    out = norm_rope_store(q, k, v, pos, cache, kc, vc, slots, **norm)
    assert out is q  # in place
    torch.testing.assert_close(q.float(), q_ref.float(), **TOL[dtype])
    assert torch.equal(k, k_before) and torch.equal(v, v_before)  # k and v go to the cache only
    assert torch.equal(vc, vc_ref)  # v is stored as it is
    torch.testing.assert_close(kc.float(), kc_ref.float(), **TOL[dtype])
    untouched = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(kc.flatten(0, 1)[untouched], kc_ref.flatten(0, 1)[untouched])


def test_norm_rope_store_writes_q_into_q_out_when_given() -> None:
    _, q, k, v, pos, kc, vc, slots, (qw, kw) = _case(torch.float32, 4, 2, 64)
    cache = _cos_sin_cache(64, 64)
    q_before = q.clone()
    q_ref = norm_rope_store_ref(q, k, v, pos, cache, kc.clone(), vc.clone(), slots,
                                q_weight=qw, k_weight=kw)
    q_out = torch.full_like(q_before, float("nan"))
    got = norm_rope_store(q, k, v, pos, cache, kc, vc, slots, q_weight=qw, k_weight=kw,
                          q_out=q_out)
    assert got is q_out and torch.equal(q, q_before)
    torch.testing.assert_close(q_out, q_ref, **TOL[torch.float32])
    with pytest.raises(ValueError, match="q_out"):
        norm_rope_store(q, k, v, pos, cache, kc, vc, slots, q_out=q_out[:, :2])


def test_norm_rope_store_skips_padding_slots() -> None:
    _, q, k, v, pos, kc, vc, _, _ = _case(torch.float32, 2, 2, 64)
    slots = torch.full((q.shape[0],), -1, dtype=torch.int64)
    kc_before, vc_before = kc.clone(), vc.clone()
    norm_rope_store(q, k, v, pos, _cos_sin_cache(64, 64), kc, vc, slots)
    assert torch.equal(kc, kc_before) and torch.equal(vc, vc_before)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5)])
def test_norm_rope_store_quantizes_an_fp8_cache_like_the_reference(
        cache_dtype: torch.dtype, scales: tuple[float, float]) -> None:
    # NOTE: RoPE alone in fp32 is the reference's arithmetic op for op, so the FP8 bytes must be
    # identical (a one-ulp difference could round to another FP8 value).
    _, q, k, v, pos, kc, vc, slots, _ = _case(torch.float32, 4, 2, 64, cache_dtype=cache_dtype)
    k.mul_(60)  # into e4m3's saturation range for some values
    cache = _cos_sin_cache(64, 64)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = norm_rope_store_ref(q, k, v, pos, cache, kc_ref, vc_ref, slots, *scales)
    norm_rope_store(q, k, v, pos, cache, kc, vc, slots, *scales)
    assert torch.equal(q, q_ref)
    assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8))


def test_norm_rope_store_rejects_bad_input() -> None:
    _, q, k, v, pos, kc, vc, slots, (qw, kw) = _case(torch.float32, 4, 2, 64)
    cache = _cos_sin_cache(64, 64)
    with pytest.raises(ValueError, match="both q_weight and k_weight"):
        norm_rope_store(q, k, v, pos, cache, kc, vc, slots, q_weight=qw)
    with pytest.raises(ValueError, match="whole head"):
        norm_rope_store(q, k, v, pos, cache[:, :32], kc, vc, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        norm_rope_store(q, k, v, pos, cache, kc, vc, slots[:3])
    with pytest.raises(ValueError, match="do not fit"):
        norm_rope_store(q, k, v, pos, cache, kc[:, :, :1], vc[:, :, :1], slots)
    with pytest.raises(ValueError, match="power of two"):
        bad = torch.zeros(4, 12, 2, 64)
        norm_rope_store(q, k, v, pos, cache, bad, bad.clone(), slots)
    with pytest.raises(ValueError, match="k_scale"):
        norm_rope_store(q, k, v, pos, cache, kc, vc, slots, k_scale=0.0)
