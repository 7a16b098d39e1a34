from __future__ import annotations

import pytest
import torch

from peregrine.kernels.activation import silu_and_mul
from peregrine.kernels.reference import apply_rope_ref, rms_norm_ref, silu_and_mul_ref
from peregrine.kernels.rmsnorm import rms_norm
from peregrine.kernels.rotary import apply_rope

# Kernels and references compute in fp32 with the same roundings. NOTE: the Triton CPU interpreter
# truncates fp32 -> bf16 instead of rounding to nearest, so bf16 results may differ by an ulp per
# rounding (two roundings in RMSNorm); on a GPU they agree to the last bit or so.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    x = torch.randn(5, 96).to(dtype)  # non-power-of-two hidden size
    w = (torch.rand(96) + 0.5).to(dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-6).float(), rms_norm_ref(x, w, 1e-6).float(),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_returns_norm_and_sum(dtype: torch.dtype) -> None:
    x, res = torch.randn(2, 3, 64).to(dtype), torch.randn(2, 3, 64).to(dtype)
    w = (torch.rand(64) + 0.5).to(dtype)
    out, new_res = rms_norm(x, w, 1e-5, residual=res)
    out_ref, new_res_ref = rms_norm_ref(x, w, 1e-5, residual=res)
    assert out.shape == x.shape and new_res.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(new_res, new_res_ref)
    else:  # one rounding: at most one bf16 ulp apart (interpreter truncation)
        torch.testing.assert_close(new_res.float(), new_res_ref.float(), atol=0, rtol=2 ** -7)
    torch.testing.assert_close(out.float(), out_ref.float(), **TOL[dtype])


def test_rms_norm_writes_the_new_residual_into_residual_out() -> None:
    x, res = torch.randn(3, 64), torch.randn(3, 64)
    w = torch.rand(64) + 0.5
    buf = torch.full((8, 64), float("nan"))  # a larger fixed buffer, its first rows used
    out, new_res = rms_norm(x, w, 1e-6, residual=res, residual_out=buf[:3])
    out_ref, res_ref = rms_norm_ref(x, w, 1e-6, residual=res)
    assert new_res.data_ptr() == buf.data_ptr() and torch.equal(buf[:3], res_ref)
    assert buf[3:].isnan().all()
    torch.testing.assert_close(out, out_ref, **TOL[torch.float32])
    with pytest.raises(ValueError, match="residual_out"):
        rms_norm(x, w, 1e-6, residual=res, residual_out=torch.empty(3, 32))


def _cos_sin_cache(max_pos: int, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)  # (max_pos, rot/2)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # (max_pos, rot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_in_place_matches_reference(dtype: torch.dtype, rotary_dim: int) -> None:
    # q and k are strided views into a fused qkv, as the attention layer hands them over.
    qkv = torch.randn(6, 4 + 2 + 2, 64).to(dtype)
    q, k = qkv[:, :4], qkv[:, 4:6]
    positions = torch.tensor([0, 1, 2, 17, 40, 99])
    cache = _cos_sin_cache(128, rotary_dim)
    q_ref, k_ref = apply_rope_ref(q, k, positions, cache)
    v_before = qkv[:, 6:].clone()
    q_out, k_out = apply_rope(q, k, positions, cache)
    assert q_out is q and k_out is k  # in place, returned for convenience
    torch.testing.assert_close(q.float(), q_ref.float(), **TOL[dtype])
    torch.testing.assert_close(k.float(), k_ref.float(), **TOL[dtype])
    assert torch.equal(qkv[:, 6:], v_before)


def test_rope_reference_matches_hf_rotate_half() -> None:
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    positions = torch.tensor([3, 0, 7])
    cache = _cos_sin_cache(8, 16)
    cos = cache[positions, :8].repeat(1, 2)[:, None]  # (T, 1, D), HF duplicates the halves
    sin = cache[positions, 8:].repeat(1, 2)[:, None]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x[..., 8:], x[..., :8]], dim=-1)

    q_ref, k_ref = apply_rope_ref(q, k, positions, cache)
    torch.testing.assert_close(q_ref, q * cos + rotate_half(q) * sin)
    torch.testing.assert_close(k_ref, k * cos + rotate_half(k) * sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    x = (torch.randn(3, 2, 2 * 80) * 3).to(dtype)
    out = silu_and_mul(x)
    assert out.shape == (3, 2, 80)
    torch.testing.assert_close(out.float(), silu_and_mul_ref(x).float(), **TOL[dtype])


def test_silu_and_mul_reference_is_gate_then_up() -> None:
    x = torch.randn(4, 10)
    torch.testing.assert_close(silu_and_mul_ref(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])


def test_short_kernels_release_the_next_one_early_only_at_batches_a_gemv_serves() -> None:
    """RMSNorm, the decode merge and SiLU-and-mul let the next kernel be scheduled at their
    start only with dependent launches and at row counts some GEMV takes (its cut-offs): above
    them GEMMs follow, which keep the release at exit."""
    from peregrine.kernels import _utils
    from peregrine.kernels.gemv import GEMV_MAX_ROWS
    pdl, plain = {"PDL": True, "launch_pdl": True}, {"PDL": False}
    assert _utils.RELEASE_MAX_ROWS == GEMV_MAX_ROWS
    assert all(_utils.release_before_gemv(pdl, rows)
               for rows in range(1, _utils.RELEASE_MAX_ROWS + 1))
    assert not _utils.release_before_gemv(pdl, _utils.RELEASE_MAX_ROWS + 1)
    assert not _utils.release_before_gemv(plain, 1)
    assert _utils.pdl_args(torch.zeros(1)) == plain  # the CPU: plain launches, no release


def test_the_rope_store_kernel_releases_the_split_kernel_early_where_gemvs_follow(
        monkeypatch) -> None:
    """By default the norm/RoPE/K-V store kernel releases the decode split kernel at its start
    where the layer's projections are dependent-launch GEMVs, under the short kernels' rule
    (dependent launches, decode batches a GEMV serves); RELEASE_ROPE_STORE forces it on or
    off."""
    from peregrine.kernels import _utils
    pdl, plain = {"PDL": True, "launch_pdl": True}, {"PDL": False}
    assert _utils.RELEASE_ROPE_STORE is None
    assert not _utils.release_rope_store(pdl, 1)
    assert not _utils.release_rope_store(pdl, 1, gemv_projections=False)
    assert _utils.release_rope_store(pdl, 1, gemv_projections=True)
    assert _utils.release_rope_store(pdl, _utils.RELEASE_MAX_ROWS, gemv_projections=True)
    assert not _utils.release_rope_store(pdl, _utils.RELEASE_MAX_ROWS + 1, gemv_projections=True)
    assert not _utils.release_rope_store(plain, 1, gemv_projections=True)
    monkeypatch.setattr(_utils, "RELEASE_ROPE_STORE", True)
    assert _utils.release_rope_store(pdl, 1) and _utils.release_rope_store(
        pdl, _utils.RELEASE_MAX_ROWS)
    assert not _utils.release_rope_store(pdl, _utils.RELEASE_MAX_ROWS + 1)
    assert not _utils.release_rope_store(plain, 1)
    monkeypatch.setattr(_utils, "RELEASE_ROPE_STORE", False)
    assert not _utils.release_rope_store(pdl, 1, gemv_projections=True)


def test_which_methods_launch_their_gemvs_as_dependents() -> None:
    """Every quantization method whose small batches run this project's GEMVs says so; the bf16
    layer (cuBLAS) does not."""
    from peregrine.layers.quantization import awq, fp8, gptq, int8, unquantized, wna16
    from peregrine.layers.quantization.compressed_tensors_wna16 import (
        CompressedTensorsWNA16Method)
    assert not unquantized.UnquantizedLinearMethod.dependent_launches
    for cls in (wna16.WNA16LinearMethod, awq.AWQLinearMethod, gptq.GPTQLinearMethod,
                CompressedTensorsWNA16Method, fp8.Fp8W8A8Method, fp8.Fp8OnlineMethod,
                fp8.Fp8BlockMethod, int8.Int8W8A8Method):
        assert cls.dependent_launches, cls.__name__
