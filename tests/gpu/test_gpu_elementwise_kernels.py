"""The compiled RMSNorm, SiLU-and-mul, RoPE and store_kv kernels match the references at Llama-8B
shapes (CUDA, bf16)."""
from __future__ import annotations

import pytest
import torch

from gpu_cases import DEV, ELEM_TOL, rel_err
from peregrine.kernels import reference as ref
from peregrine.kernels.activation import silu_and_mul
from peregrine.kernels.rmsnorm import rms_norm
from peregrine.kernels.rotary import apply_rope
from peregrine.kernels.store_kv import store_kv

pytestmark = pytest.mark.gpu

TOKENS, HIDDEN, INTER, HQ, HKV, HEAD_DIM = 4096, 4096, 14336, 32, 8, 128
DTYPE = torch.bfloat16


def test_rms_norm_with_residual_matches_reference() -> None:
    x = torch.randn(TOKENS, HIDDEN, device=DEV, dtype=DTYPE)  # (T, H)
    res = torch.randn_like(x)  # (T, H)
    w = torch.rand(HIDDEN, device=DEV, dtype=DTYPE) + 0.5  # (H,)
    out, new_res = rms_norm(x, w, 1e-6, residual=res)
    out_ref, res_ref = ref.rms_norm_ref(x, w, 1e-6, residual=res)
    assert rel_err(out, out_ref) <= ELEM_TOL
    assert rel_err(new_res, res_ref) <= ELEM_TOL


def test_silu_and_mul_matches_reference() -> None:
    g = torch.randn(TOKENS, 2 * INTER, device=DEV, dtype=DTYPE)  # (T, 2I)
    assert rel_err(silu_and_mul(g), ref.silu_and_mul_ref(g)) <= ELEM_TOL


def test_rope_in_place_matches_reference() -> None:
    qkv = torch.randn(TOKENS, HQ + 2 * HKV, HEAD_DIM, device=DEV, dtype=DTYPE)  # (T, Hq+2Hkv, D)
    q, k = qkv[:, :HQ], qkv[:, HQ:HQ + HKV]  # strided views, as the attention layer passes them
    v_before = qkv[:, HQ + HKV:].clone()
    pos = torch.randint(0, 8192, (TOKENS,), device=DEV)  # (T,)
    inv = 1.0 / 500000 ** (torch.arange(0, HEAD_DIM, 2, device=DEV).float() / HEAD_DIM)
    freqs = torch.outer(torch.arange(8192, device=DEV).float(), inv)  # (8192, D/2)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # (8192, D)
    q_ref, k_ref = ref.apply_rope_ref(q, k, pos, cache)
    apply_rope(q, k, pos, cache)
    assert rel_err(q, q_ref) <= ELEM_TOL
    assert rel_err(k, k_ref) <= ELEM_TOL
    assert torch.equal(qkv[:, HQ + HKV:], v_before)


def test_store_kv_writes_exactly_the_reference_slots() -> None:
    slots = torch.randperm(TOKENS * 2, device=DEV)[:TOKENS]  # (T,)
    slots[::7] = -1  # padding tokens store nothing
    kv = torch.randn(TOKENS, 2, HKV, HEAD_DIM, device=DEV, dtype=DTYPE)  # (T, 2, Hkv, D)
    kc = torch.randn(TOKENS * 2 // 16, 16, HKV, HEAD_DIM, device=DEV, dtype=DTYPE)  # (N, 16, Hkv, D)
    vc, kc_ref, vc_ref = kc.clone(), kc.clone(), kc.clone()
    store_kv(kv[:, 0], kv[:, 1], kc, vc, slots)
    ref.store_kv_ref(kv[:, 0], kv[:, 1], kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref)
    assert torch.equal(vc, vc_ref)


@pytest.mark.parametrize("rows", [1, 143, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lm_head_float32_out_gemm_is_the_exact_sum_rounded_once(rows: int, dtype: torch.dtype,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from peregrine.layers import embedding
    vocab, hidden = 151936, 1024
    head = embedding.ParallelLMHead(vocab, hidden, dtype=dtype).to(DEV)
    head.weight.data.normal_(0, hidden ** -0.5)
    x = torch.randn(rows, hidden, device=DEV).to(dtype)  # (N, H)
    exact = x.double() @ head.weight.double().t()  # (N, V)
    assert head._fp32_out(x)
    fresh = head.compute_logits(x)  # (N, V)
    shared = torch.full((rows + 3, vocab), float("nan"), device=DEV)
    into = head.compute_logits(x, out=shared[:rows])
    assert into.data_ptr() == shared.data_ptr() and torch.isnan(shared[rows:]).all()
    assert fresh.dtype == torch.float32 and torch.equal(fresh, shared[:rows])
    monkeypatch.setattr(embedding, "FP32_OUT_GEMM", False)
    two_pass = head.compute_logits(x)  # 16-bit logits, converted
    # float32 sums rounded once: within float32 accumulation error of the exact product, and at
    # least as close to it as the 16-bit logits are; the two forms differ by 16-bit rounding only.
    err, err_two = (fresh.double() - exact).abs().max(), (two_pass.double() - exact).abs().max()
    assert err <= 1e-4 * exact.abs().max() and err <= err_two
    assert (fresh - two_pass).abs().max() <= exact.abs().max() * 2 ** -7
