"""The fused dequant-GEMM (under Triton's interpreter, tiny shapes) equals dequantize-then-matmul
for 4, 6 and 8-bit weights, with and without zero points, contiguous groups, one group per
channel, act-order group indices and split-K."""
from __future__ import annotations

import pytest
import torch

from peregrine.kernels.wna16_gemm import GemmConfig, choose_config, smem_bytes, wna16_gemm
from peregrine.layers.quantization.wna16 import WNA16Layout, pack_int32, unpack_int32


def _layout(k: int, n: int, bits: int, group: int, zp: bool, act_order: bool,
            seed: int = 0) -> WNA16Layout:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (k, n), generator=g)
    groups = k // group
    scales = torch.rand(groups, n, generator=g) * 0.02 + 0.005
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=g).float() if zp else None
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=g)]
    return WNA16Layout.build(q, scales, zeros, g_idx, bits, torch.float32)


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("zp", [False, True])
def test_kernel_matches_dequantized_matmul(bits: int, zp: bool) -> None:
    w = _layout(128, 48, bits, 32, zp, act_order=False)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    want = x @ w.dequantize(torch.float32).t()
    torch.testing.assert_close(wna16_gemm(x, w), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("split", [1, 2, 4])
def test_split_k_sums_every_part(split: int) -> None:
    w = _layout(128, 32, 4, 32, zp=True, act_order=False, seed=2)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    cfg = GemmConfig(block_m=16, block_n=32, block_k=32, split_k=split, num_warps=4, num_stages=1)
    want = x @ w.dequantize(torch.float32).t()
    torch.testing.assert_close(wna16_gemm(x, w, cfg), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("zp", [False, True])
def test_split_blocks_past_k_read_no_group_row_past_the_scales(zp: bool) -> None:
    """3 splits of 2 blocks over K's 4 blocks: the last split's second block lies past K. Its
    products are zero, and so must be what it reads: the scales (and zero points) here sit in a
    larger buffer whose rows past them hold NaN, which a read of the row past the last group
    would carry into the sums (0 * NaN)."""
    w = _layout(128, 32, 4, 64, zp, act_order=False, seed=4)
    for name in ("scales", "zeros") if zp else ("scales",):
        t = getattr(w, name)
        buf = torch.full((t.shape[0] + 2, t.shape[1]), float("nan"), dtype=t.dtype)
        buf[:t.shape[0]] = t
        setattr(w, name, buf[:t.shape[0]])
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5))
    cfg = GemmConfig(block_m=16, block_n=32, block_k=32, split_k=3, num_warps=4, num_stages=1)
    want = x @ w.dequantize(torch.float32).t()
    torch.testing.assert_close(wna16_gemm(x, w, cfg), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("zp", [False, True])
def test_act_order_gathers_each_inputs_group(zp: bool) -> None:
    w = _layout(64, 32, 4, 16, zp, act_order=True, seed=4)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(5))
    want = x @ w.dequantize(torch.float32).t()
    torch.testing.assert_close(wna16_gemm(x, w), want, rtol=1e-4, atol=1e-4)


def test_one_group_per_channel_and_leading_dims() -> None:
    w = _layout(64, 16, 8, 64, zp=False, act_order=False, seed=6)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(7))
    want = x @ w.dequantize(torch.float32).t()
    got = wna16_gemm(x, w)
    assert got.shape == (2, 3, 16)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_packing_round_trips_and_six_bits_use_two_planes() -> None:
    q = torch.randint(0, 64, (32, 4))
    w = WNA16Layout.build(q, torch.ones(1, 4), None, None, 6, torch.float32)
    assert w.qweight.shape == (4, 4) and w.qweight_hi.shape == (2, 4)
    assert torch.equal(w.unpacked(), q.int())
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    v = torch.randint(0, 16, (3, 16))
    assert torch.equal(unpack_int32(pack_int32(v, 4, 1, order), 4, 1, order), v.int())


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="not supported"):
        WNA16Layout.build(torch.zeros(16, 4, dtype=torch.int32), torch.ones(1, 4), None, None, 3,
                          torch.float32)
    with pytest.raises(ValueError, match="g_idx holds groups"):
        WNA16Layout.build(torch.zeros(16, 4, dtype=torch.int32), torch.ones(1, 4), None,
                          torch.full((16,), 2), 4, torch.float32)
    w = _layout(64, 16, 4, 64, zp=False, act_order=False)
    with pytest.raises(ValueError, match="x has 32 inputs"):
        wna16_gemm(torch.zeros(1, 32), w)


def test_config_splits_k_for_small_batches_only() -> None:
    decode = choose_config(1, 4096, 4096, 128, False, num_sms=132)
    prefill = choose_config(2048, 4096, 4096, 128, False, num_sms=132)
    assert decode.split_k > 1 and prefill.split_k == 1
    assert 128 % decode.block_k == 0 and 128 % prefill.block_k == 0


def test_shared_memory_estimate_matches_the_failed_six_bit_compile() -> None:
    # The H200 refused 6-bit BM 32, BN 64, BK 128, 4 stages: it asked for 237,568 bytes.
    assert smem_bytes(32, 64, 128, 4, bits=6) == 237_568


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_every_config_fits_the_h200s_shared_memory(bits: int) -> None:
    limit = 232_448
    for m in (1, 16, 17, 64, 65, 256, 257, 4096):
        for a_bytes in (2, 4):
            c = choose_config(m, 4096, 14336, 128, False, 132, bits, a_bytes, limit)
            assert smem_bytes(c.block_m, c.block_n, c.block_k, c.num_stages, bits,
                              a_bytes) <= limit - 4 * 1024, (m, a_bytes, c)
            assert c.num_stages >= 2 and 128 % c.block_k == 0
    # 4 and 8 bits keep the pipeline they had; only 6 bits give up a stage, where it must.
    four = choose_config(64, 4096, 4096, 128, False, 132, 4)
    six = choose_config(64, 4096, 4096, 128, False, 132, 6)
    assert four.num_stages == 4 and six.num_stages == 3
    assert choose_config(16, 4096, 4096, 128, False, 132, 6).num_stages == 4  # 225,280 B fit
