"""The small-batch split-K GEMV for weight-only int weights (under Triton's interpreter, tiny
shapes) equals dequantize-then-matmul for 4, 6 and 8 bits, with and without zero points, groups of
32 / 64 / 128 inputs and one group per channel, 1 to 8 rows, 16-bit activations; its split-K sums
are the same bits every run; act-order weights are left to the GEMM. The tensor-core variant (4 /
8 bits, 16-bit activations; here its plain-Triton dequantization) is within an output ulp of the
reference and refuses what it cannot read; so are the in-place variant and its prefetching form
(4 / 8 bits, every group size, split-K past K, unaligned bf16 rows), which the dispatch picks by
default where they read the layout."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from peregrine.kernels.gemv import GEMV_MAX_ROWS, block_m_for, choose_split
from peregrine.kernels.wna16_gemv import (GemvConfig, gemv_config, gemv_supported,
                                          mma_supported, wna16_gemv)
from peregrine.kernels import wna16_gemv as wna16_gemv_module
from peregrine.layers.quantization.wna16 import WNA16Layout

K, N = 256, 64


def _layout(bits: int, group: int, zp: bool, dtype: torch.dtype = torch.float32,
            act_order: bool = False, k: int = K, n: int = N, seed: int = 0) -> WNA16Layout:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (k, n), generator=g)
    groups = k // group
    scales = torch.rand(groups, n, generator=g) * 0.02 + 0.005
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=g).float() if zp else None
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=g)] if act_order else None
    return WNA16Layout.build(q, scales, zeros, g_idx, bits, dtype)


def _x(m: int, dtype: torch.dtype = torch.float32, k: int = K, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _reference(x: torch.Tensor, w: WNA16Layout) -> torch.Tensor:
    return x.float() @ w.dequantize(torch.float32).t()  # (M, N) float32


@pytest.mark.parametrize("group", [32, 64, 128, K], ids=["g32", "g64", "g128", "channel"])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_gemv_matches_dequantized_matmul(bits: int, zp: bool, group: int) -> None:
    w = _layout(bits, group, zp)
    x = _x(3)  # padded to 4 compiled rows: the fourth must not leak into the output
    got = wna16_gemv(x, w)
    assert got.shape == (3, N) and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_every_row_count_up_to_the_cut_off(m: int) -> None:
    w = _layout(4, 64, zp=True, seed=2)
    x = _x(m, seed=m)
    torch.testing.assert_close(wna16_gemv(x, w), _reference(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits", [4, 6])
def test_16_bit_activations_round_only_the_output(dtype: torch.dtype, bits: int) -> None:
    w = _layout(bits, 128, zp=bits == 4, dtype=dtype, seed=3)
    x = _x(2, dtype)
    got = wna16_gemv(x, w)
    want = _reference(x, w)  # the same 16-bit scales, zeros and x, summed in float32
    assert got.dtype == dtype
    # NOTE: one rounding of each output (the interpreter truncates bf16: up to 2^-7 relative).
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert ((got.float() - want).abs() / want.abs().max()).max() < tol


@pytest.mark.parametrize("split", [1, 2, 4])
def test_split_k_adds_every_split_and_repeats_bit_for_bit(split: int) -> None:
    w = _layout(8, 32, zp=True, seed=4)
    x = _x(3, seed=5)
    cfg = GemvConfig(block_n=32, block_k=64, split_k=split, k_iters=4 // split, num_warps=4)
    first = wna16_gemv(x, w, cfg)
    torch.testing.assert_close(first, _reference(x, w), rtol=1e-5, atol=1e-4)
    assert torch.equal(first, wna16_gemv(x, w, cfg))


def test_ragged_n_and_k_and_leading_dims() -> None:
    w = _layout(6, 16, zp=True, k=144, n=40, seed=6)  # K = 144: the last K block is partial
    x = torch.randn(2, 2, 144, generator=torch.Generator().manual_seed(7))
    got = wna16_gemv(x, w, GemvConfig(block_n=16, block_k=64, split_k=2, k_iters=2,
                                      num_warps=4))
    assert got.shape == (2, 2, 40)
    torch.testing.assert_close(got, _reference(x.reshape(4, 144), w).reshape(2, 2, 40),
                               rtol=1e-5, atol=1e-4)


def test_act_order_and_odd_groups_are_left_to_the_gemm() -> None:
    assert not gemv_supported(_layout(4, 32, zp=True, act_order=True))
    assert gemv_supported(_layout(4, 32, zp=True))
    w = _layout(4, 32, zp=False, act_order=True)
    with pytest.raises(ValueError, match="act-order: True"):
        wna16_gemv(_x(1), w)


def test_bad_inputs_are_named() -> None:
    w = _layout(4, 128, zp=False)
    with pytest.raises(ValueError, match="x has 128 inputs"):
        wna16_gemv(torch.zeros(1, 128), w)
    with pytest.raises(ValueError, match=f"1 to {GEMV_MAX_ROWS} rows"):
        wna16_gemv(torch.zeros(GEMV_MAX_ROWS + 1, K), w)
    with pytest.raises(ValueError, match="powers of two"):
        wna16_gemv(_x(1), w, GemvConfig(block_n=16, block_k=96, split_k=1, k_iters=3,
                                        num_warps=4))
    with pytest.raises(ValueError, match="do not cover the 256 inputs"):
        wna16_gemv(_x(1), w, GemvConfig(block_n=16, block_k=64, split_k=2, k_iters=1,
                                        num_warps=4))


def test_row_buckets_and_split_choice() -> None:
    assert [block_m_for(m) for m in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    dev = torch.device("cpu")
    split, iters = choose_split(tiles=1, k_blocks=5, device=dev)
    assert split * iters >= 5 and (split - 1) * iters < 5  # every split has a K block
    assert choose_split(tiles=10_000, k_blocks=64, device=dev) == (1, 64)
    # fewer programs per SM, fewer splits: 8 "SMs" on the CPU, 4 or 3.5 programs each
    assert choose_split(tiles=7, k_blocks=64, device=dev) == (8, 8)
    assert choose_split(tiles=7, k_blocks=64, device=dev, waves=3.5) == (4, 16)


def _ulps(got: torch.Tensor, x: torch.Tensor, w: WNA16Layout) -> float:
    """The largest |got - x @ dequant(w)| in output ulps (eps times the reference's magnitude,
    at least its RMS)."""
    want = _reference(x, w)
    unit = torch.maximum(want.abs(), want.pow(2).mean().sqrt()) * torch.finfo(got.dtype).eps
    return ((got.float() - want).abs() / unit).max().item()


# NOTE: in the mma variant q - zero and x are exact in 16 bits and the sums float32 (K = 256:
# ~1e-6 relative), so the output's rounding is the only visible error: under half an ulp, under
# one where the interpreter truncates bf16. A misplaced value or a wrong zero costs whole units.
ULP = 1.001


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("bits", [4, 8])
def test_mma_variant_rounds_only_the_output(bits: int, zp: bool, dtype: torch.dtype) -> None:
    w = _layout(bits, 128, zp, dtype=dtype, seed=8)
    x = _x(3, dtype, seed=9)
    got = wna16_gemv(x, w, variant="mma")
    assert got.shape == (3, N) and got.dtype == dtype
    assert _ulps(got, x, w) < ULP


@pytest.mark.parametrize("group", [16, 32, 64, K], ids=["g16", "g32", "g64", "channel"])
def test_mma_variant_takes_blocks_of_one_group(group: int) -> None:
    w = _layout(4, group, zp=True, dtype=torch.bfloat16, seed=10)
    cfg = gemv_config(w, torch.device("cpu"), 1, "mma")
    assert cfg.block_k == min(group, 128)
    x = _x(2, torch.bfloat16, seed=11)
    assert _ulps(wna16_gemv(x, w, variant="mma"), x, w) < ULP


@pytest.mark.parametrize("split", [1, 2, 4])
def test_mma_split_k_adds_every_split_and_repeats_bit_for_bit(split: int) -> None:
    w = _layout(4, 64, zp=True, dtype=torch.float16, k=512, seed=12)
    x = _x(5, torch.float16, k=512, seed=13)
    cfg = GemvConfig(block_n=32, block_k=64, split_k=split, k_iters=8 // split, num_warps=4)
    first = wna16_gemv(x, w, cfg, variant="mma")
    assert _ulps(first, x, w) < ULP
    assert torch.equal(first, wna16_gemv(x, w, cfg, variant="mma"))


def test_mma_variant_ragged_n_and_k() -> None:
    # N = 40 against 32-column tiles, K = 144 (one group per channel) against 64-input blocks:
    # the masked tails of both, the last split shorter than the others.
    w = _layout(4, 144, zp=True, dtype=torch.bfloat16, k=144, n=40, seed=14)
    x = _x(3, torch.bfloat16, k=144, seed=15)
    cfg = GemvConfig(block_n=32, block_k=64, split_k=2, k_iters=2, num_warps=4)
    assert _ulps(wna16_gemv(x, w, cfg, variant="mma"), x, w) < ULP
    w8 = _layout(8, 144, zp=False, dtype=torch.float16, k=144, n=40, seed=16)
    assert _ulps(wna16_gemv(x.half(), w8, cfg, variant="mma"), x.half(), w8) < ULP


def test_the_default_variant_and_every_variant_agrees() -> None:
    w = _layout(4, 128, zp=True, dtype=torch.bfloat16, seed=17)
    x = _x(4, torch.bfloat16, seed=18)
    # off the GPU (no tensor-core variant): 4-bit: packed halves at 1 row of 16-bit x, in place
    # (prefetching at 3-4 rows); 8-bit: in place up to 2 rows (prefetching at 1), fma above;
    # 6-bit: packed halves at 1 row, fma above; act-order: fma
    chosen = []
    real = wna16_gemv_module._variant
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(wna16_gemv_module, "_variant",
                   lambda *a: chosen.append(real(*a)) or chosen[-1])
        w8 = _layout(8, 128, zp=False, dtype=torch.bfloat16, seed=19)
        w6 = _layout(6, 128, zp=True, dtype=torch.bfloat16, seed=20)
        for xx, ww in ((x[:1], w), (x[:2], w), (x[:3], w), (x, w), (x[:1], w8), (x[:2], w8),
                       (x[:3], w8), (x[:1], w6), (x[:2], w6)):
            wna16_gemv(xx, ww)
    assert chosen == ["half2_prefetch", "inplace", "inplace_prefetch", "inplace_prefetch",
                      "inplace_prefetch", "inplace", "fma", "half2_prefetch", "fma"]
    assert torch.equal(wna16_gemv(x, w), wna16_gemv(x, w, variant="inplace"))
    for variant in ("fma", "fma_prefetch", "mma", "inplace"):
        assert _ulps(wna16_gemv(x, w, variant=variant), x, w) < ULP, variant


@pytest.mark.slow  # (a variant for benchmarks; about 5 s under the interpreter)
@pytest.mark.parametrize("bits, group, zp", [(4, 32, True), (6, 16, True), (8, 128, False),
                                             (4, K, False)])
def test_fma_prefetch_equals_fma_bit_for_bit(bits: int, group: int, zp: bool) -> None:
    # K = 192: 3 blocks of 64 in 2 splits of 2, so the last split's second block and the
    # prefetch past it lie beyond K (nothing read); N = 40 against 16-column tiles.
    w = _layout(bits, group if group != K else 192, zp, k=192, n=40, seed=19)
    x = _x(3, k=192, seed=20)
    cfg = GemvConfig(block_n=16, block_k=64, split_k=2, k_iters=2, num_warps=4)
    got = wna16_gemv(x, w, cfg, variant="fma_prefetch")
    torch.testing.assert_close(got, _reference(x, w), rtol=1e-5, atol=1e-4)
    assert torch.equal(got, wna16_gemv(x, w, cfg, variant="fma"))


def test_mma_variant_refuses_what_it_cannot_read() -> None:
    x16 = _x(1, torch.bfloat16)
    assert not mma_supported(_layout(6, 128, zp=True), torch.bfloat16, torch.device("cpu"))
    assert not mma_supported(_layout(4, 128, zp=True), torch.float32, torch.device("cpu"))
    assert not mma_supported(_layout(4, 8, zp=True), torch.bfloat16, torch.device("cpu"))
    assert not mma_supported(_layout(4, 32, zp=True, act_order=True), torch.bfloat16,
                             torch.device("cpu"))
    with pytest.raises(ValueError, match="6 bits"):
        wna16_gemv(x16, _layout(6, 128, zp=True, dtype=torch.bfloat16), variant="mma")
    with pytest.raises(ValueError, match="torch.float32"):
        wna16_gemv(_x(1), _layout(4, 128, zp=True), variant="mma")
    with pytest.raises(ValueError, match="unknown variant 'fast'"):
        wna16_gemv(x16, _layout(4, 128, zp=True, dtype=torch.bfloat16), variant="fast")


# NOTE: the in-place variant's q - zero is exact and x * 2^-(b p) too (a power of two), so in
# float32 it differs from the reference only by the order of the float32 sums.
@pytest.mark.parametrize("group", [32, 64, 128, K], ids=["g32", "g64", "g128", "channel"])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("bits", [4, 8])
def test_inplace_variant_matches_dequantized_matmul(bits: int, zp: bool, group: int) -> None:
    w = _layout(bits, group, zp, seed=11)
    x = _x(3, seed=12)
    got = wna16_gemv(x, w, variant="inplace")
    assert got.shape == (3, N) and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_inplace_variant_rounds_only_the_output(m: int, dtype: torch.dtype) -> None:
    w = _layout(4, 128, zp=True, dtype=dtype, seed=13)
    x = _x(m, dtype, seed=14)
    assert _ulps(wna16_gemv(x, w, variant="inplace"), x, w) < ULP


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("split", [1, 2, 4])
def test_inplace_split_k_and_ragged_shapes(split: int, dtype: torch.dtype) -> None:
    k, n = 384, 72  # 3 groups of 128; the last column tile is partial
    w = _layout(4, 128, zp=True, k=k, n=n, seed=15, dtype=dtype)
    x = _x(2, k=k, seed=16).to(dtype)
    cfg = GemvConfig(32, 128, split, -(-3 // split), 4)  # 2 splits: a block past K
    first = wna16_gemv(x, w, cfg, variant="inplace")
    if dtype == torch.float32:
        torch.testing.assert_close(first, _reference(x, w), rtol=1e-5, atol=1e-4)
    else:
        assert _ulps(first, x, w) < ULP
    assert torch.equal(first, wna16_gemv(x, w, cfg, variant="inplace"))


def test_inplace_variant_reads_unaligned_bf16_rows_one_value_at_a_time() -> None:
    w = _layout(4, 128, zp=True, dtype=torch.bfloat16, seed=17)
    buf = _x(2 * K + 1, torch.bfloat16).reshape(-1)[: 2 * K + 1]
    xu = buf[1:].view(2, K)  # 2 bytes past an aligned base: no 8-byte loads
    got = wna16_gemv(xu, w, variant="inplace")
    assert torch.equal(got, wna16_gemv(xu.clone(), w, variant="inplace"))
    assert _ulps(got, xu, w) < ULP


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("bits, zp", [(4, True), (8, False)])
def test_inplace_prefetch_equals_inplace_bit_for_bit(bits: int, zp: bool, split: int) -> None:
    """The same sums in the same order, only the loads issued an iteration earlier."""
    k = 384
    w = _layout(bits, 128, zp, dtype=torch.bfloat16, k=k, seed=21)
    x = _x(3, torch.bfloat16, k=k, seed=22)
    cfg = GemvConfig(64, 128, split, -(-3 // split), 4)
    got = wna16_gemv(x, w, cfg, variant="inplace_prefetch")
    assert torch.equal(got, wna16_gemv(x, w, cfg, variant="inplace"))
    assert _ulps(got, x, w) < ULP


def test_inplace_variant_refuses_what_it_cannot_read() -> None:
    x = _x(1)
    with pytest.raises(ValueError, match="inplace variant takes 4 / 8-bit"):
        wna16_gemv(x, _layout(6, 128, zp=True), variant="inplace")
    with pytest.raises(ValueError, match="inplace variant takes 4 / 8-bit"):
        wna16_gemv(x, _layout(4, 32, zp=True, act_order=True), variant="inplace")
    with pytest.raises(ValueError, match="inplace variant takes 4 / 8-bit"):
        wna16_gemv(x, _layout(4, 64, zp=True), GemvConfig(64, 128, 1, 2, 4), variant="inplace")


# NOTE: under the interpreter the half2 variant sums in float32 (its packed fp16 arithmetic is
# inline PTX, checked at real shapes on the GPU), so it meets the float32 reference as in-place
# does; x * 2^-8 and the scale * 2^8 that undoes it are exact.
@pytest.mark.parametrize("group", [32, 64, 128, K], ids=["g32", "g64", "g128", "channel"])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
def test_half2_variant_matches_dequantized_matmul(zp: bool, group: int) -> None:
    w = _layout(4, group, zp, seed=31)
    x = _x(1, seed=32)
    got = wna16_gemv(x, w, variant="half2")
    assert got.shape == (1, N) and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("split", [1, 2])
def test_half2_split_k_ragged_and_prefetch(split: int, dtype: torch.dtype) -> None:
    k, n = 384, 72  # 3 groups of 128; the last column tile is partial
    w = _layout(4, 128, zp=True, k=k, n=n, seed=33, dtype=dtype)
    x = _x(1, k=k, seed=34).to(dtype)
    cfg = GemvConfig(32, 128, split, -(-3 // split), 4)  # 2 splits: a block past K
    got = wna16_gemv(x, w, cfg, variant="half2")
    assert _ulps(got, x, w) < ULP
    assert torch.equal(got, wna16_gemv(x, w, cfg, variant="half2"))
    assert torch.equal(got, wna16_gemv(x, w, cfg, variant="half2_prefetch"))
    assert torch.equal(got, wna16_gemv(x, w, cfg, variant="half2_prefetch_x"))
    assert torch.equal(got, wna16_gemv(x, w, cfg, variant="half2_prefetch2"))
    # two word rows of a column added before the scale: the float32 sums in another order
    paired = wna16_gemv(x, w, cfg, variant="half2_pair")
    assert _ulps(paired, x, w) < ULP
    assert torch.equal(paired, wna16_gemv(x, w, cfg, variant="half2_pair"))
    assert torch.equal(got, wna16_gemv(x, w, cfg._replace(num_stages=3), variant="half2_async"))
    # 2 splits of 2 blocks over 5 blocks: the loads two blocks ahead run past K and the range
    long = _layout(4, 128, zp=True, k=640, n=n, seed=36, dtype=dtype)
    xl = _x(1, k=640, seed=37).to(dtype)
    cfg = GemvConfig(32, 128, 3, 2, 4)
    got = wna16_gemv(xl, long, cfg, variant="half2_prefetch2")
    assert _ulps(got, xl, long) < ULP
    assert torch.equal(got, wna16_gemv(xl, long, cfg, variant="half2"))
    assert torch.equal(got, wna16_gemv(xl, long, cfg, variant="half2_prefetch_x"))


# NOTE: 6-bit values: low nibbles in the 4-bit words, the two high bits of 16 values per word
# of a second plane; under the interpreter the sums are float32, as for 4 bits.
@pytest.mark.parametrize("group", [16, 32, 128, K], ids=["g16", "g32", "g128", "channel"])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
def test_half2_variant_reads_6_bit_weights(zp: bool, group: int) -> None:
    w = _layout(6, group, zp, seed=40)
    x = _x(1, seed=41)
    for variant in ("half2", "half2_prefetch", "half2_prefetch2"):
        got = wna16_gemv(x, w, variant=variant)
        assert got.shape == (1, N)
        torch.testing.assert_close(got, _reference(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("split", [1, 2])
def test_6_bit_half2_split_k_ragged_gated_and_by_default(split: int, dtype: torch.dtype) -> None:
    """An odd count of 16-input high-bits rows per split, ragged columns, gated inputs; the
    default variant at one row of 6-bit weights and 16-bit x."""
    from peregrine.kernels.activation import silu_and_mul
    k, n = 384, 72
    w = _layout(6, 128, zp=False, k=k, n=n, seed=42, dtype=dtype)
    x = _x(1, k=k, seed=43).to(dtype)
    cfg = GemvConfig(32, 128, split, -(-3 // split), 4)
    got = wna16_gemv(x, w, cfg, variant="half2")
    assert _ulps(got, x, w) < ULP
    assert torch.equal(got, wna16_gemv(x, w, cfg, variant="half2_prefetch"))
    assert torch.equal(got, wna16_gemv(x, w, cfg, variant="half2_prefetch_x"))
    assert wna16_gemv_module._variant(w, x, None, None) == "half2_prefetch"
    h = (_x(1, k=2 * k, seed=44) * 3).to(dtype)
    assert wna16_gemv_module.gated_supported(w, h)
    assert torch.equal(wna16_gemv(h, w, cfg, variant="half2_prefetch", gated=True),
                       wna16_gemv(silu_and_mul(h), w, cfg, variant="half2_prefetch"))
    with pytest.raises(ValueError, match="half2 variant takes one row"):
        wna16_gemv(x, w, variant="half2_staged")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("split", [1, 2])
def test_gated_inputs_equal_the_activation_kernel_then_the_gemv(split: int,
                                                                dtype: torch.dtype) -> None:
    """x = silu(h[:K]) * h[K:] computed inside the GEMV as it reads h (2K,): the activation
    kernel's output fed to the same variant, bit for bit, ragged splits included."""
    from peregrine.kernels.activation import silu_and_mul
    k, n = 384, 72
    w = _layout(4, 128, zp=True, k=k, n=n, seed=38, dtype=dtype)
    h = (_x(1, k=2 * k, seed=39) * 3).to(dtype)  # gates well into silu's curved part
    cfg = GemvConfig(32, 128, split, -(-3 // split), 4)  # 2 splits: a block past K
    x = silu_and_mul(h)
    for variant in ("half2", "half2_prefetch", "half2_prefetch2", "half2_async", "half2_pair"):
        got = wna16_gemv(h, w, cfg, variant=variant, gated=True)
        assert got.shape == (1, n)
        assert torch.equal(got, wna16_gemv(x, w, cfg, variant=variant)), variant
    assert wna16_gemv_module.gated_supported(w, h)
    assert not wna16_gemv_module.gated_supported(w, x)  # not a gate-and-up row
    assert not wna16_gemv_module.gated_supported(w, torch.cat([h, h]))  # two rows


# NOTE: the staged variant sums q x and takes z times each block's input sum off after; under
# the interpreter that is float32 throughout, so it meets the float32 reference closely.
@pytest.mark.parametrize("group", [32, 64, 128, K], ids=["g32", "g64", "g128", "channel"])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
def test_staged_variant_matches_dequantized_matmul(zp: bool, group: int) -> None:
    w = _layout(4, group, zp, seed=41)
    x = _x(1, seed=42)
    got = wna16_gemv(x, w, variant="half2_staged")
    assert got.shape == (1, N) and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.slow  # (a variant for benchmarks; about 6 s under the interpreter)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("split", [1, 2, 3])
def test_staged_split_k_ragged_and_gated(split: int, dtype: torch.dtype) -> None:
    """Ragged K splits (a block past K, a split past the program's range) round only the output;
    gated rows give the activation kernel's output fed to the same variant, bit for bit."""
    from peregrine.kernels.activation import silu_and_mul
    k, n = 640, 72  # 5 groups of 128; the last column tile is partial
    w = _layout(4, 128, zp=True, k=k, n=n, seed=43, dtype=dtype)
    x = _x(1, k=k, seed=44).to(dtype)
    cfg = GemvConfig(32, 128, split, -(-5 // split), 4)
    got = wna16_gemv(x, w, cfg, variant="half2_staged")
    assert _ulps(got, x, w) < ULP
    assert torch.equal(got, wna16_gemv(x, w, cfg, variant="half2_staged"))
    h = (_x(1, k=2 * k, seed=45) * 3).to(dtype)
    gated = wna16_gemv(h, w, cfg, variant="half2_staged", gated=True)
    assert torch.equal(gated, wna16_gemv(silu_and_mul(h), w, cfg, variant="half2_staged"))


def test_staged_variant_stages_more_rows_than_one_pass() -> None:
    """A program whose K range spans more word rows than it stages at a time (128 with 4 warps)
    and an unaligned bf16 row (read one value at a time)."""
    k = 2048 + 128  # 17 blocks, one split: 272 word rows, three staging passes
    w = _layout(4, 128, zp=True, k=k, n=40, seed=46, dtype=torch.bfloat16)
    x = _x(1, k=k + 1, seed=47).to(torch.bfloat16)[:, 1:]  # 2 bytes off 8-byte alignment
    got = wna16_gemv(x, w, GemvConfig(32, 128, 1, 17, 4), variant="half2_staged")
    assert _ulps(got, x, w) < ULP


def test_gated_inputs_are_refused_where_no_variant_takes_them() -> None:
    w = _layout(4, 128, zp=True)
    h = _x(1, k=2 * K).to(torch.bfloat16)
    with pytest.raises(ValueError, match="gated inputs take a variant read through registers"):
        wna16_gemv(h, w, variant="inplace", gated=True)
    with pytest.raises(ValueError, match=r"twice that"):
        wna16_gemv(_x(1).to(torch.bfloat16), w, variant="half2", gated=True)
    assert not wna16_gemv_module.gated_supported(_layout(8, 128, zp=True), h)  # 8 bits


def test_tc_variant_is_refused_off_the_gpu_and_its_splits_cover_k_in_whole_groups(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensor-core variant is Gluon (CUDA only): asked for by name on the CPU it is refused
    with the reason; picked through PEREGRINE_WNA16_GEMV it falls back to the default. Its K
    split always divides the groups of 128 inputs, whatever the tile count asks for."""
    w = _layout(4, 128, zp=True, dtype=torch.bfloat16)
    x = _x(1).to(torch.bfloat16)
    with pytest.raises(ValueError, match="tc variant takes at most 8 rows of 16-bit x"):
        wna16_gemv(x, w, variant="tc")
    monkeypatch.setenv("PEREGRINE_WNA16_GEMV", "tc")
    assert wna16_gemv_module._variant(w, x, None, None) == "half2_prefetch"
    cpu = torch.device("cpu")
    for k, n in ((4096, 6144), (14336, 4096), (5120, 128), (384, 64), (128, 8)):
        fake = SimpleNamespace(in_features=k, out_features=n, bits=4)
        cfg = wna16_gemv_module.tc_config(fake, cpu)
        assert cfg.split_k * cfg.k_iters * 128 == k and cfg.block_k == 128
        assert cfg.block_n == 16 * wna16_gemv_module._TC_V * cfg.num_warps


def test_layouts_the_tc_variant_serves_take_the_gemv_up_to_8_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The row cut-off between the GEMV and the GEMM: 8 rows where the tensor-core variant reads
    the layout at the activation dtype (checked as on a GPU), GEMV_MAX_M elsewhere (a CPU layout,
    float32 activations, 8-bit weights); the layer sends its rows accordingly."""
    import peregrine.layers.quantization.wna16 as wna16
    from peregrine.kernels import wna16_gemm
    from peregrine.kernels.gemv import GEMV_MAX_M
    w4, w6, w8 = (_layout(b, 128, zp=True, dtype=torch.bfloat16) for b in (4, 6, 8))
    assert wna16_gemv_module.max_rows(w4, torch.bfloat16) == GEMV_MAX_M  # CPU tensors
    real = wna16_gemv_module._tc_layout_ok
    monkeypatch.setattr(wna16_gemv_module, "_is_sm80_or_later", lambda index: True)
    monkeypatch.setattr(wna16_gemv_module, "_tc_layout_ok",
                        lambda w, dtype: real(SimpleNamespace(
                            **{f: getattr(w, f) for f in ("bits", "g_idx", "in_features",
                                                          "group_size", "out_features",
                                                          "scales", "zeros", "qweight_hi")},
                            qweight=SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0),
                                                    data_ptr=w.qweight.data_ptr)), dtype))
    assert wna16_gemv_module.max_rows(w4, torch.bfloat16) == 8
    assert wna16_gemv_module.max_rows(w6, torch.float16) == 8
    assert wna16_gemv_module.max_rows(w4, torch.float32) == GEMV_MAX_M
    assert wna16_gemv_module.max_rows(w8, torch.bfloat16) == GEMV_MAX_M
    assert wna16_gemv_module.max_rows(_layout(4, 64, zp=True, dtype=torch.bfloat16),
                                      torch.bfloat16) == GEMV_MAX_M  # groups of 64
    monkeypatch.setattr(wna16_gemv_module, "_TC_ROWS", 1)
    assert wna16_gemv_module.max_rows(w4, torch.bfloat16) == GEMV_MAX_M
    monkeypatch.undo()
    # the layer: rows 1..8 to the GEMV and 9 to the GEMM where max_rows says 8
    calls = []
    monkeypatch.setattr(wna16, "_use_kernel", lambda x: True)
    monkeypatch.setattr("peregrine.kernels.gemv.use_gemv",
                        lambda x, max_m=GEMV_MAX_M: 0 < x.numel() // x.shape[-1] <= max_m)
    monkeypatch.setattr(wna16_gemv_module, "max_rows", lambda w, dtype: 8)
    monkeypatch.setattr(wna16_gemv_module, "wna16_gemv",
                        lambda x, w: calls.append(("gemv", x.shape[0])) or x[:, :N])
    monkeypatch.setattr(wna16_gemm, "wna16_gemm",
                        lambda x, w: calls.append(("gemm", x.shape[0])) or x[:, :N])
    layer = SimpleNamespace(wna16=w4)
    for m in (1, 5, 8, 9):
        wna16.WNA16LinearMethod.apply(None, layer, _x(m, torch.bfloat16))
    assert calls == [("gemv", 1), ("gemv", 5), ("gemv", 8), ("gemm", 9)]


def test_half2_variant_reads_unaligned_bf16_rows_one_value_at_a_time() -> None:
    w = _layout(4, 128, zp=False, dtype=torch.bfloat16, seed=35)
    buf = _x(1, torch.bfloat16, k=K + 1).reshape(-1)
    xu = buf[1:].view(1, K)  # 2 bytes past an aligned base: no 8-byte loads
    got = wna16_gemv(xu, w, variant="half2")
    assert torch.equal(got, wna16_gemv(xu.clone(), w, variant="half2"))
    assert _ulps(got, xu, w) < ULP


def test_half2_variant_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="half2 variant takes one row"):
        wna16_gemv(_x(2), _layout(4, 128, zp=True), variant="half2")
    with pytest.raises(ValueError, match="half2 variant takes one row"):
        wna16_gemv(_x(1), _layout(8, 128, zp=True), variant="half2")
    with pytest.raises(ValueError, match="half2 variant takes one row"):
        wna16_gemv(_x(1), _layout(4, 32, zp=True, act_order=True), variant="half2_prefetch")


def test_one_row_variant_from_the_environment(monkeypatch) -> None:
    w = _layout(4, 128, zp=True, dtype=torch.bfloat16, seed=45)
    x = _x(1, torch.bfloat16, seed=46)
    chosen = []
    real = wna16_gemv_module._variant
    monkeypatch.setattr(wna16_gemv_module, "_variant",
                        lambda *a: chosen.append(real(*a)) or chosen[-1])
    try:
        for name in ("half2_async", "inplace", None):
            if name is None:
                monkeypatch.delenv("PEREGRINE_WNA16_GEMV", raising=False)
            else:
                monkeypatch.setenv("PEREGRINE_WNA16_GEMV", name)
            wna16_gemv_module._one_row_variant.cache_clear()
            assert _ulps(wna16_gemv(x, w), x, w) < ULP
        assert chosen == ["half2_async", "inplace", "half2_prefetch"]
        monkeypatch.setenv("PEREGRINE_WNA16_GEMV", "fastest")
        wna16_gemv_module._one_row_variant.cache_clear()
        with pytest.raises(ValueError, match="PEREGRINE_WNA16_GEMV: unknown variant 'fastest'"):
            wna16_gemv(x, w)
    finally:
        wna16_gemv_module._one_row_variant.cache_clear()


def test_tc_one_row_split_rises_to_the_largest_divisor_that_stays_in_one_wave(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One row of 4-bit weights: the K split becomes the largest divisor of the groups whose
    programs stay within _TC_ONE_ROW_PER_SM an SM (never below the general rule's split); more
    rows, and 6-bit weights, keep that rule."""
    monkeypatch.setattr(wna16_gemv_module, "_sms", lambda device: 132)
    monkeypatch.setattr(wna16_gemv_module, "_TC_ONE_ROW_PER_SM", 28)
    monkeypatch.setattr(wna16_gemv_module, "_TC_WARPS", 1)
    monkeypatch.setattr(wna16_gemv_module, "_TC_V", 2)
    import peregrine.kernels.gemv as gemv_module
    monkeypatch.setattr(gemv_module, "_sms", lambda device: 132)
    cpu = torch.device("cpu")
    # (K, N): the general rule's split, the one-row split (Llama-3-8B, then Llama-2-70B)
    cases = {(4096, 6144): (16, 16), (4096, 4096): (16, 16), (4096, 28672): (4, 4),
             (14336, 4096): (16, 28), (28672, 8192): (8, 14), (8192, 57344): (2, 2)}
    for (k, n), (general, one_row) in cases.items():
        fake = SimpleNamespace(in_features=k, out_features=n, bits=4)
        rows8 = wna16_gemv_module.tc_config(fake, cpu, rows=8)
        row1 = wna16_gemv_module.tc_config(fake, cpu)
        assert (rows8.split_k, row1.split_k) == (general, one_row), (k, n)
        tiles = -(-n // row1.block_n)
        assert (k // 128) % row1.split_k == 0 and row1.split_k * row1.k_iters * 128 == k
        assert row1.split_k == general or tiles * row1.split_k <= 28 * 132
        six = SimpleNamespace(in_features=k, out_features=n, bits=6)
        assert wna16_gemv_module.tc_config(six, cpu).split_k == general
    monkeypatch.setattr(wna16_gemv_module, "_TC_ONE_ROW_PER_SM", 0)
    fake = SimpleNamespace(in_features=14336, out_features=4096, bits=4)
    assert wna16_gemv_module.tc_config(fake, cpu).split_k == 16
