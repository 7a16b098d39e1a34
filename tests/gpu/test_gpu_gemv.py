"""The small-batch GEMVs compiled at Llama-3-8B shapes, through the quantization methods' dispatch
(GEMV up to GEMV_MAX_M rows for the int layout, 8 where its tensor-core variant serves it, and
W8_GEMV_MAX_M for 8-bit weights, the GEMMs above): weight-only int (4, 6, 8 bits, zero points,
groups, per channel, fp16), FP8 per channel and 128x128 blocks, int8 per channel, each against
dequantize-then-matmul of x as it is at M <= GEMV_MAX_M; the int layout's tensor-core variant
(4 / 6 bits, bf16 / fp16, every shape, 1 to 8 rows, ragged shapes) and its in-place variant (4 /
8 bits, bf16 / fp16, every shape, ragged and unaligned) within one output ulp, and fma_prefetch
equal to fma bit for bit; repeats (deterministic split-K), CUDA-graph replay, nothing compiled
after load, 6-bit GEMM tiles that compile at every batch size."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpu_cases import DEV, rel_err
from peregrine.kernels.fp8_quant import FP8_DTYPE, block_dequantize, per_token_group_quant_ref
from peregrine.kernels.gemv import GEMV_MAX_M, W8_GEMV_MAX_M, precompile_w8_gemv, w8_gemv
from peregrine.kernels.wna16_gemm import wna16_gemm
from peregrine.kernels.wna16_gemv import (_wna16_gemv_fma_kernel, gated_supported, gemv_config,
                                          max_rows, mma_supported, precompile_wna16_gemv,
                                          wna16_gemv)
from peregrine.kernels.wna16_gemv_half2 import _wna16_gemv_half2_kernel
from peregrine.kernels.wna16_gemv_staged import _wna16_gemv_staged_kernel
from peregrine.kernels.wna16_gemv_inplace import _wna16_gemv_inplace_kernel
from peregrine.kernels.wna16_gemv_mma import _wna16_gemv_mma_kernel
from peregrine.kernels.wna16_gemv_tc import wna16_gemv_tc_kernel
from peregrine.layers.quantization.fp8 import (Fp8BlockMethod, apply_fp8_linear, fp8_gemm_supported,
                                               unrounded_rows)
from peregrine.layers.quantization.int8 import apply_int8_linear
from peregrine.layers.quantization.wna16 import WNA16LinearMethod, WNA16Layout
from peregrine.testing import fp8_pack

pytestmark = pytest.mark.gpu

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}
ROWS = (1, 2, 3, 4, 5, 8, 9, 16)  # across the cut-off
GEMM_TOL = 2 ** -6


def _layout(k: int, n: int, bits: int, zp: bool, dtype: torch.dtype = torch.bfloat16,
            group: int = 128) -> WNA16Layout:
    q = torch.randint(0, 1 << bits, (k, n), device=DEV, dtype=torch.int32)
    scales = torch.rand(k // group, n, device=DEV) * 0.01 + 0.002
    zeros = torch.randint(0, 1 << bits, (k // group, n), device=DEV).float() if zp else None
    return WNA16Layout.build(q, scales, zeros, None, bits, dtype)


def _wna16_apply(w: WNA16Layout, x: torch.Tensor) -> torch.Tensor:
    # NOTE: the method's apply reads only layer.wna16; this is the layers' own dispatch.
    return WNA16LinearMethod.apply(None, SimpleNamespace(wna16=w), x)


def _check_wna16(x: torch.Tensor, w: WNA16Layout) -> None:
    want = x.float() @ w.dequantize(torch.float32).t()  # (M, N)
    got = _wna16_apply(w, x)
    assert got.dtype == x.dtype and got.shape == want.shape
    # NOTE: x and the integers are exact in 16 bits, the sums float32: the output's rounding
    # dominates (as in test_gpu_wna16.py), measured against the output's RMS.
    err = (got.float() - want).abs().max().item() / want.pow(2).mean().sqrt().item()
    assert err < (2e-2 if x.dtype == torch.bfloat16 else 4e-3), err


def _needs_fp8() -> None:
    if not fp8_gemm_supported(torch.empty(1, device=DEV, dtype=torch.bfloat16)):
        pytest.skip("FP8 needs compute capability 8.9+")


def _compiled(fn) -> int:
    return sum(len(c[0]) for c in fn.device_caches.values())


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_int4_awq_style_across_the_cut_off(shape: str, m: int) -> None:
    k, n = SHAPES[shape]
    w = _layout(k, n, 4, zp=True)
    _check_wna16(torch.randn(m, k, device=DEV, dtype=torch.bfloat16), w)


@pytest.mark.parametrize("m", (1, 3, 8))
@pytest.mark.parametrize("bits, zp, group", [(6, False, 128), (8, False, 128), (4, False, 32),
                                             (8, True, 64), (6, True, 4096), (4, True, 4096)])
def test_bits_zero_points_and_groups(bits: int, zp: bool, group: int, m: int) -> None:
    k, n = SHAPES["qkv"]
    _check_wna16(torch.randn(m, k, device=DEV, dtype=torch.bfloat16),
                 _layout(k, n, bits, zp, group=group))


@pytest.mark.parametrize("m", (1, 8))
def test_fp16_activations_and_the_long_k_projection(m: int) -> None:
    k, n = SHAPES["down"]
    _check_wna16(torch.randn(m, k, device=DEV, dtype=torch.float16),
                 _layout(k, n, 4, zp=True, dtype=torch.float16))


@pytest.mark.parametrize("m", (16, 17, 64, 65, 256, 2048))
def test_six_bit_gemm_compiles_and_matches_at_every_batch_size(m: int) -> None:
    k, n = SHAPES["o"]
    w = _layout(k, n, 6, zp=False)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    want = x.float() @ w.dequantize(torch.float32).t()
    err = (wna16_gemm(x, w).float() - want).abs().max().item() / want.pow(2).mean().sqrt().item()
    assert err < 2e-2, err


def test_split_k_is_deterministic_and_graph_capturable() -> None:
    k, n = SHAPES["o"]  # the most K splits of the four shapes
    w = _layout(k, n, 4, zp=True)
    x = torch.randn(3, k, device=DEV, dtype=torch.bfloat16)
    first = wna16_gemv(x, w)
    for _ in range(50):
        assert torch.equal(wna16_gemv(x, w), first)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = wna16_gemv(x, w)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, wna16_gemv(x, w))


def _gemv_compiles() -> int:
    return sum(_compiled(f) for f in (_wna16_gemv_fma_kernel, _wna16_gemv_mma_kernel,
                                      _wna16_gemv_inplace_kernel, _wna16_gemv_half2_kernel,
                                      _wna16_gemv_staged_kernel, wna16_gemv_tc_kernel))


@pytest.mark.parametrize("bits", [4, 6, 8])  # 8-bit: in place up to 2 rows, fma above
def test_nothing_compiles_after_load_time_precompile(bits: int) -> None:
    k, n = SHAPES["gate_up"]
    w = _layout(k, n, bits, zp=bits == 4)
    precompile_wna16_gemv(w, torch.bfloat16)
    before = _gemv_compiles()
    rows = max_rows(w, torch.bfloat16)
    assert rows == (8 if bits in (4, 6) else GEMV_MAX_M)  # the tensor-core GEMV takes 8
    for m in range(1, rows + 1):
        wna16_gemv(torch.randn(m, k, device=DEV, dtype=torch.bfloat16), w)
    h = torch.randn(1, 2 * k, device=DEV, dtype=torch.bfloat16)
    if gated_supported(w, h):  # a down projection's one-row form, SiLU-and-mul inside
        wna16_gemv(h, w, gated=True)
    assert _gemv_compiles() == before
    if bits in (4, 6):  # 1 to 8 rows take the tensor-core variant, compiled at load
        assert _compiled(wna16_gemv_tc_kernel) > 0


def _exact_err(got: torch.Tensor, x: torch.Tensor, w: WNA16Layout) -> float:
    """The largest |got - x @ dequant(w)| in units of the output dtype's rounding of the
    reference (its ulp at the reference's magnitude, at least the RMS's)."""
    want = x.float() @ w.dequantize(torch.float32).t()  # (M, N)
    eps = torch.finfo(x.dtype).eps
    unit = torch.maximum(want.abs(), want.pow(2).mean().sqrt()) * eps
    return ((got.float() - want).abs() / unit).max().item()


# (bits, zero points, activation dtype, group) for the 16-bit-exact variants; group 0: one per
# output channel.
EXACT_CASES = [(4, True, torch.bfloat16, 128), (4, False, torch.bfloat16, 128),
               (4, True, torch.float16, 128), (4, False, torch.float16, 32),
               (8, False, torch.bfloat16, 128), (8, True, torch.bfloat16, 64),
               (8, False, torch.float16, 128), (8, True, torch.float16, 0),
               (4, True, torch.bfloat16, 0)]


@pytest.mark.parametrize("m", (1, 2, 3, 4, 8))
@pytest.mark.parametrize("bits, zp, dtype, group", EXACT_CASES,
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_mma_variant_rounds_only_the_output(shape: str, bits: int, zp: bool,
                                            dtype: torch.dtype, group: int, m: int) -> None:
    """The tensor-core variant (inline-PTX dequantization) at every Llama-3-8B shape.
    NOTE: q - zero and x are exact in 16 bits, products exact in float32, and K <= 14336 float32
    additions err by < K * 2^-24 relative to the sum of |terms| (~ sqrt(K) times the result for
    random signs): < 0.01 of an output ulp. So the only visible error is the output's rounding
    (half an ulp); 1 ulp leaves room for a tie and the sums' order."""
    k, n = SHAPES[shape]
    w = _layout(k, n, bits, zp, dtype=dtype, group=group or k)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    assert mma_supported(w, dtype, x.device)
    got = wna16_gemv(x, w, variant="mma")
    assert got.dtype == dtype and got.shape == (m, n)
    assert _exact_err(got, x, w) <= 1.0


@pytest.mark.parametrize("m", (1, 2, 3, 4, 8))
@pytest.mark.parametrize("bits, zp, dtype, group", EXACT_CASES,
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_inplace_variant_rounds_only_the_output(shape: str, bits: int, zp: bool,
                                                dtype: torch.dtype, group: int, m: int) -> None:
    """The in-place variant (inline-PTX dequantization in float32) at every Llama-3-8B shape:
    (q - zero) * 2^(b p) and x * 2^-(b p) are exact, the sums float32, so as for the mma
    variant only the output's rounding shows."""
    k, n = SHAPES[shape]
    w = _layout(k, n, bits, zp, dtype=dtype, group=group or k)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    got = wna16_gemv(x, w, variant="inplace")
    assert got.dtype == dtype and got.shape == (m, n)
    assert _exact_err(got, x, w) <= 1.0


@pytest.mark.parametrize("bits, zp, dtype, group", [c for c in EXACT_CASES if c[0] == 4],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_half2_variant_within_fp16_sums(shape: str, bits: int, zp: bool, dtype: torch.dtype,
                                        group: int) -> None:
    """The packed-half variant (one row, 4 bits) at every Llama-3-8B shape. NOTE: q - zero is
    exact in fp16 and so is a 16-bit x * 2^-8 above fp16's normal floor; each word's four
    products and their sum round to fp16 (a relative 2^-11 of the word's sum), which adds up
    over K to about 2^-11 of the result for random signs: a sixteenth of a bf16 output ulp and
    half an fp16 one, beside the output's own half-ulp rounding."""
    k, n = SHAPES[shape]
    w = _layout(k, n, bits, zp, dtype=dtype, group=group or k)
    x = torch.randn(1, k, device=DEV, dtype=dtype)
    got = wna16_gemv(x, w, variant="half2")
    assert got.dtype == dtype and got.shape == (1, n)
    assert _exact_err(got, x, w) <= 2.0
    assert torch.equal(wna16_gemv(x, w, variant="half2_prefetch"), got)
    assert torch.equal(wna16_gemv(x, w, variant="half2_prefetch2"), got)
    assert torch.equal(wna16_gemv(x, w, variant="half2_prefetch_x"), got)  # x a block ahead
    # two word rows of a column summed in fp16 lanes (eight products) before float32
    assert _exact_err(wna16_gemv(x, w, variant="half2_pair"), x, w) <= 2.0
    # the words streamed through shared memory (cp.async): the same per-word sums, maybe
    # summed over the words in another order
    streamed = wna16_gemv(x, w, variant="half2_async")
    assert _exact_err(streamed, x, w) <= 2.0
    assert torch.equal(wna16_gemv(x, w, variant="half2_async"), streamed)
    # large inputs (the scaling keeps the fp16 products finite; fp16 x and outputs have their
    # own ceiling) and an unaligned row
    big = x * (4096 if dtype == torch.bfloat16 else 16)
    assert _exact_err(wna16_gemv(big, w, variant="half2"), big, w) <= 2.0
    buf = torch.randn(k + 1, device=DEV, dtype=dtype)
    xu = buf[1:].view(1, k)
    assert _exact_err(wna16_gemv(xu, w, variant="half2"), xu, w) <= 2.0


@pytest.mark.parametrize("bits, zp, dtype, group", [c for c in EXACT_CASES if c[0] == 4],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_staged_variant_within_fp16_sums(shape: str, bits: int, zp: bool, dtype: torch.dtype,
                                         group: int) -> None:
    """The staged packed-half variant at every Llama-3-8B shape. NOTE: its word sums are q x,
    not (q - zero) x, in fp16, the zero point taken off in float32 with each block's input sum;
    those sums are about twice as large as the packed-half variant's, and so is their rounding:
    a bound of 3 output ulps where that variant has 2 (fp16 outputs show it; bf16 ones hardly).
    Large inputs and an unaligned row too."""
    k, n = SHAPES[shape]
    w = _layout(k, n, bits, zp, dtype=dtype, group=group or k)
    x = torch.randn(1, k, device=DEV, dtype=dtype)
    got = wna16_gemv(x, w, variant="half2_staged")
    assert got.dtype == dtype and got.shape == (1, n)
    assert _exact_err(got, x, w) <= 3.0
    assert torch.equal(wna16_gemv(x, w, variant="half2_staged"), got)
    big = x * (4096 if dtype == torch.bfloat16 else 16)
    assert _exact_err(wna16_gemv(big, w, variant="half2_staged"), big, w) <= 3.0
    buf = torch.randn(k + 1, device=DEV, dtype=dtype)
    xu = buf[1:].view(1, k)
    assert _exact_err(wna16_gemv(xu, w, variant="half2_staged"), xu, w) <= 3.0


@pytest.mark.parametrize("bits, zp, dtype, group",
                         [c for c in EXACT_CASES if c[0] == 4 and c[3] % 128 == 0]
                         + [(6, True, torch.bfloat16, 128), (6, False, torch.float16, 128)],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tc_variant_within_an_output_ulp(shape: str, bits: int, zp: bool, dtype: torch.dtype,
                                         group: int) -> None:
    """The tensor-core variant (one row, 4 or 6 bits) at every Llama-3-8B shape, at its default
    launch and at every tile width, warp count and K split it can take: float32 sums of the
    exact integers, scaled once a group, so within one output ulp of the exact result; the
    same bits every launch, also for large inputs and a column count that leaves a partial
    tile."""
    from peregrine.kernels.gemv import GemvConfig
    k, n = SHAPES[shape]
    w = _layout(k, n, bits, zp, dtype=dtype, group=group or k)
    x = torch.randn(1, k, device=DEV, dtype=dtype)
    got = wna16_gemv(x, w, variant="tc")
    assert got.dtype == dtype and got.shape == (1, n)
    assert _exact_err(got, x, w) <= 1.0
    assert torch.equal(wna16_gemv(x, w, variant="tc"), got)
    for v, warps, split in ((1, 4, 1), (2, 2, 4), (4, 8, 2), (4, 1, 8)):
        cfg = GemvConfig(16 * v * warps, 128, split, k // 128 // split, warps)
        assert _exact_err(wna16_gemv(x, w, cfg, variant="tc"), x, w) <= 1.0
    big = x * (4096 if dtype == torch.bfloat16 else 16)
    assert _exact_err(wna16_gemv(big, w, variant="tc"), big, w) <= 1.0
    ragged = _layout(k, n - 40, bits, zp, dtype=dtype, group=group or k)
    assert _exact_err(wna16_gemv(x, ragged, variant="tc"), x, ragged) <= 1.0
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = wna16_gemv(x, w, variant="tc")
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, wna16_gemv(x, w, variant="tc"))


@pytest.mark.parametrize("m", (2, 3, 5, 8))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tc_variant_takes_up_to_8_rows(shape: str, dtype: torch.dtype, m: int) -> None:
    """B's 8 columns are x's rows: 2 to 8 rows within one output ulp of the exact product at
    every Llama-3-8B shape, one split and several, and the gated form (rows 2K apart) bit for
    bit against the activation kernel then the GEMV."""
    from peregrine.kernels.activation import silu_and_mul
    from peregrine.kernels.gemv import GemvConfig
    k, n = SHAPES[shape]
    w = _layout(k, n, 4, True, dtype=dtype)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    got = wna16_gemv(x, w, variant="tc")
    assert got.shape == (m, n) and _exact_err(got, x, w) <= 1.0
    one = GemvConfig(32, 128, 1, k // 128, 1)
    assert _exact_err(wna16_gemv(x, w, one, variant="tc"), x, w) <= 1.0
    if shape == "down":
        h = torch.randn(m, 2 * k, device=DEV, dtype=dtype) * 3
        assert torch.equal(wna16_gemv(h, w, variant="tc", gated=True),
                           wna16_gemv(silu_and_mul(h), w, variant="tc"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("variant", [None, "half2", "half2_prefetch2", "half2_async",
                                     "half2_staged", "tc"])
def test_gated_down_projection_is_the_activation_kernel_then_the_gemv(
        variant: str | None, dtype: torch.dtype) -> None:
    """Llama-3-8B's down projection of one gate-and-up row: silu(gate) * up computed inside the
    GEMV gives the activation kernel's output fed to the same GEMV, bit for bit. The default
    one-row variant (tensor cores) does not fuse it: there every lane would compute it, which
    costs more than the activation kernel, so the layer runs that kernel first."""
    from peregrine.kernels.activation import silu_and_mul
    from peregrine.kernels.wna16_gemv import gated_supported
    k, n = SHAPES["down"]
    w = _layout(k, n, 4, True, dtype=dtype)
    h = torch.randn(1, 2 * k, device=DEV, dtype=dtype) * 3
    assert not gated_supported(w, h)
    got = wna16_gemv(h, w, variant=variant, gated=True)
    assert torch.equal(got, wna16_gemv(silu_and_mul(h), w, variant=variant))


def test_inplace_variant_reads_unaligned_bf16_rows() -> None:
    # bf16 rows that do not start 8 bytes apart from an aligned base: one value per load.
    k, n = 4160, 6200
    w = _layout(k, n, 4, zp=True, group=k)
    buf = torch.randn(3 * k + 1, device=DEV, dtype=torch.bfloat16)
    xu = buf[1:].view(3, k)  # 2 bytes past an aligned address
    got = wna16_gemv(xu, w, variant="inplace")
    assert torch.equal(got, wna16_gemv(xu.clone(), w, variant="inplace"))
    assert _exact_err(got, xu, w) <= 1.0


@pytest.mark.parametrize("m", (1, 3, 8))
@pytest.mark.parametrize("bits, zp", [(4, True), (8, False)])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_inplace_prefetch_is_inplace_bit_for_bit(shape: str, bits: int, zp: bool, m: int) -> None:
    k, n = SHAPES[shape]
    w = _layout(k, n, bits, zp)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    assert torch.equal(wna16_gemv(x, w, variant="inplace_prefetch"),
                       wna16_gemv(x, w, variant="inplace"))


@pytest.mark.parametrize("variant", ["mma", "fma", "fma_prefetch", "inplace", "inplace_prefetch"])
def test_every_variant_is_exact_and_repeats_bit_for_bit(variant: str) -> None:
    k, n = SHAPES["down"]  # the longest K: the most K blocks per split
    w = _layout(k, n, 4, zp=True)
    x = torch.randn(4, k, device=DEV, dtype=torch.bfloat16)
    first = wna16_gemv(x, w, variant=variant)
    assert _exact_err(first, x, w) <= 1.0
    for _ in range(20):
        assert torch.equal(wna16_gemv(x, w, variant=variant), first)


@pytest.mark.parametrize("variant", ["mma", "inplace"])
def test_ragged_shapes_and_explicit_configs(variant: str) -> None:
    # N not a multiple of the column tile, K not a multiple of the K block (one group per
    # channel), and a single split (the output written directly).
    k, n = 4160, 6200
    w = _layout(k, n, 4, zp=True, group=k)
    x = torch.randn(3, k, device=DEV, dtype=torch.bfloat16)
    assert _exact_err(wna16_gemv(x, w, variant=variant), x, w) <= 1.0
    cfg = gemv_config(w, x.device, 4, variant)._replace(split_k=1, k_iters=-(-k // 128))
    assert _exact_err(wna16_gemv(x, w, cfg, variant=variant), x, w) <= 1.0


def test_mma_applies_to_4_and_8_bits_with_16_bit_activations_on_sm90() -> None:
    k, n = SHAPES["o"]
    w4, w6 = _layout(k, n, 4, zp=True), _layout(k, n, 6, zp=False)
    x = torch.randn(2, k, device=DEV, dtype=torch.bfloat16)
    assert mma_supported(w4, x.dtype, x.device) == (torch.cuda.get_device_capability() >= (9, 0))
    assert not mma_supported(w6, x.dtype, x.device)
    assert not mma_supported(w4, torch.float32, x.device)
    assert torch.equal(wna16_gemv(x, w4), wna16_gemv(x, w4, variant="tc"))  # the default


@pytest.mark.parametrize("m", (1, 3, 8))
@pytest.mark.parametrize("bits, zp, group", [(4, True, 128), (8, False, 128), (6, True, 128),
                                             (4, False, 32)])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fma_prefetch_is_fma_bit_for_bit(shape: str, bits: int, zp: bool, group: int,
                                         m: int) -> None:
    """The same sums in the same order, only the loads issued an iteration earlier."""
    k, n = SHAPES[shape]
    w = _layout(k, n, bits, zp, group=group)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    got = wna16_gemv(x, w, variant="fma_prefetch")
    assert torch.equal(got, wna16_gemv(x, w, variant="fma"))
    assert _exact_err(got, x, w) <= 1.0


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fp8_per_channel_across_the_cut_off(shape: str, m: int) -> None:
    _needs_fp8()
    k, n = SHAPES[shape]
    wq, ws = fp8_pack.quantize_per_channel(torch.randn(n, k, device=DEV) * 0.02, FP8_DTYPE)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    got = apply_fp8_linear(x, wq, ws.t().contiguous(), None, None)
    if unrounded_rows(m, wq, ws.t()):  # weight-only: x as it is
        want = x.float() @ (wq.float() * ws).t()
    else:
        xq, xs = per_token_group_quant_ref(x, FP8_DTYPE)
        want = (xq.float() * xs) @ (wq.float() * ws).t()
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), want) < GEMM_TOL


@pytest.mark.parametrize("m", (1, 4, 8, 9))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fp8_block_scales_across_the_cut_off(shape: str, m: int) -> None:
    _needs_fp8()
    k, n = SHAPES[shape]
    block = (128, 128)
    wq, ws = fp8_pack.quantize_blocks(torch.randn(n, k, device=DEV) * 0.02, block)
    layer = SimpleNamespace(weight=wq, weight_scale_inv=ws)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    got = Fp8BlockMethod(block).apply(layer, x)
    if unrounded_rows(m, wq, ws, block):  # the GEMVs: x as it is
        want = x.float() @ block_dequantize(wq, ws, block).t()
    else:
        xq, xs = per_token_group_quant_ref(x, FP8_DTYPE, 128)
        want = (xq.float() * xs.repeat_interleave(128, 1)) @ block_dequantize(wq, ws, block).t()
    assert rel_err(got.float(), want) < GEMM_TOL


@pytest.mark.parametrize("wdtype", (FP8_DTYPE, torch.int8), ids=("fp8", "int8"))
@pytest.mark.parametrize("form", (0, 1))
@pytest.mark.parametrize("m", (1, 2, 4))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_w8_gemv_forms_match_the_dequantized_matmul(shape: str, m: int, form: int,
                                                    wdtype: torch.dtype) -> None:
    # both K-loop forms (the block reduced every block; per-thread sums of 16 adjacent k); int8
    # weights through the inline-PTX conversion
    if wdtype == FP8_DTYPE:
        _needs_fp8()
    k, n = SHAPES[shape]
    wq, ws = fp8_pack.quantize_per_channel(torch.randn(n, k, device=DEV) * 0.02, wdtype)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    got = w8_gemv(x, wq, ws.t().contiguous(), form=form)
    assert torch.equal(got, w8_gemv(x, wq, ws.t().contiguous(), form=form))
    assert rel_err(got.float(), x.float() @ (wq.float() * ws).t()) < GEMM_TOL


@pytest.mark.parametrize("m", (1, 2))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("wdtype", (FP8_DTYPE, torch.int8), ids=("fp8", "int8"))
def test_w8_gemv_gated_equals_the_activation_kernel_then_the_gemv(wdtype: torch.dtype,
                                                                   dtype: torch.dtype,
                                                                   m: int) -> None:
    # Llama-3-8B's down projection: silu(gate) * up computed as the GEMV reads it, bit for bit
    from peregrine.kernels.activation import silu_and_mul
    if wdtype == FP8_DTYPE:
        _needs_fp8()
    k, n = SHAPES["down"]
    wq, ws = fp8_pack.quantize_per_channel(torch.randn(n, k, device=DEV) * 0.02, wdtype)
    ws = ws.t().contiguous()
    h = torch.randn(m, 2 * k, device=DEV, dtype=dtype)
    got = w8_gemv(h, wq, ws, gated=True)
    assert torch.equal(got, w8_gemv(silu_and_mul(h), wq, ws))


@pytest.mark.parametrize("wdtype", ("fp8", "int8", "fp8-block"))
@pytest.mark.parametrize("shape", ("qkv", "gate_up", "70b-qkv"))
def test_w8_gemv_normed_row_matches_the_norm_then_the_matmul(shape: str, wdtype: str) -> None:
    # the column-parallel projections after an RMSNorm, one decode row (Llama-3-8B's, unsplit
    # launches; Llama-2-70B's qkv, split; 128 x 128 block scales, split): the norm taken into
    # the GEMV, against float32 RMSNorm then dequantize-then-matmul, and no farther from it than
    # the norm kernel then the GEMV
    from peregrine.kernels.rmsnorm import rms_norm
    if wdtype != "int8":
        _needs_fp8()
    k, n = SHAPES[shape] if shape in SHAPES else (8192, 10240)
    w = torch.randn(n, k, device=DEV) * 0.02
    block = (128, 128) if wdtype == "fp8-block" else None
    if block is None:
        wq, ws = fp8_pack.quantize_per_channel(w, FP8_DTYPE if wdtype == "fp8" else torch.int8)
        deq, ws = wq.float() * ws, ws.t().contiguous()
    else:
        wq, ws = fp8_pack.quantize_blocks(w, block)
        deq = block_dequantize(wq, ws, block)
    h = torch.randn(1, k, device=DEV, dtype=torch.bfloat16) * 4
    nw = (torch.rand(k, device=DEV) + 0.5).to(torch.bfloat16)
    got = w8_gemv(h, wq, ws, block, norm=(nw, 1e-5))
    assert torch.equal(got, w8_gemv(h, wq, ws, block, norm=(nw, 1e-5)))
    hf = h.float()
    want = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.float()) @ deq.t()
    separate = w8_gemv(rms_norm(h, nw, 1e-5), wq, ws, block)
    assert rel_err(got.float(), want) <= rel_err(separate.float(), want) + 2 ** -9


@pytest.mark.parametrize("wdtype", ("fp8", "int8"))
@pytest.mark.parametrize("shape", ("gate_up", "70b-gate_up"))
def test_w8_gemv_silu_out_equals_the_normed_gemv_then_the_activation_kernel(shape: str,
                                                                             wdtype: str) -> None:
    # gate/up after the RMSNorm at one decode row writing silu(gate) * up in its epilogue (the
    # down projection then reads I inputs): bit for bit the normed GEMV, then the activation
    # kernel, at Llama-3-8B's and Llama-2-70B's gate/up, on the launch config the layer takes
    from peregrine.kernels.activation import silu_and_mul
    from peregrine.kernels.gemv import w8_gemv_takes_silu_out
    if wdtype == "fp8":
        _needs_fp8()
    k, n = SHAPES["gate_up"] if shape == "gate_up" else (8192, 57344)
    wq, ws = fp8_pack.quantize_per_channel(torch.randn(n, k, device=DEV) * 0.02,
                                           FP8_DTYPE if wdtype == "fp8" else torch.int8)
    ws = ws.t().contiguous()
    h = torch.randn(1, k, device=DEV, dtype=torch.bfloat16) * 4
    nw = (torch.rand(k, device=DEV) + 0.5).to(torch.bfloat16)
    assert w8_gemv_takes_silu_out(1, n, k, None, DEV)
    got = w8_gemv(h, wq, ws, norm=(nw, 1e-5), silu_out=True)
    assert got.shape == (1, n // 2)
    assert torch.equal(got, silu_and_mul(w8_gemv(h, wq, ws, norm=(nw, 1e-5))))


@pytest.mark.parametrize("gated", (False, True))
@pytest.mark.parametrize("m", (1, 2))
@pytest.mark.parametrize("shape", ("o", "down"))
def test_w8_gemv_residual_equals_the_gemv_then_the_norm_kernels_add(shape: str, m: int,
                                                                    gated: bool) -> None:
    # the row-parallel projections before an RMSNorm: the residual added in the epilogue, bit
    # for bit the GEMV then the norm kernel's residual add (split and unsplit launches)
    from peregrine.kernels.rmsnorm import rms_norm
    _needs_fp8()
    k, n = SHAPES[shape]
    wq, ws = fp8_pack.quantize_per_channel(torch.randn(n, k, device=DEV) * 0.02, FP8_DTYPE)
    ws = ws.t().contiguous()
    x = torch.randn(m, 2 * k if gated else k, device=DEV, dtype=torch.bfloat16)
    res = torch.randn(m, n, device=DEV, dtype=torch.bfloat16) * 4
    got = w8_gemv(x, wq, ws, gated=gated, residual=res)
    _, want = rms_norm(w8_gemv(x, wq, ws, gated=gated), torch.ones(n, device=DEV,
                                                                 dtype=torch.bfloat16),
                       1e-6, residual=res)
    assert torch.equal(got, want)


@pytest.mark.parametrize("m", (1, 2))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_int8_weights_at_small_batches(shape: str, m: int) -> None:
    k, n = SHAPES[shape]
    wq, ws = fp8_pack.quantize_per_channel(torch.randn(n, k, device=DEV) * 0.02, torch.int8)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    got = apply_int8_linear(x, wq, ws.t().contiguous(), None, None)
    want = x.float() @ (wq.float() * ws).t()
    assert rel_err(got.float(), want) < GEMM_TOL


def test_w8_gemv_is_deterministic_and_precompiled() -> None:
    _needs_fp8()
    from peregrine.kernels.gemv import _w8_gemv_kernel
    k, n = SHAPES["down"]
    wq, ws = fp8_pack.quantize_per_channel(torch.randn(n, k, device=DEV) * 0.02, FP8_DTYPE)
    ws = ws.t().contiguous()
    precompile_w8_gemv(wq, ws, torch.bfloat16)
    before = _compiled(_w8_gemv_kernel)
    x = torch.randn(W8_GEMV_MAX_M, k, device=DEV, dtype=torch.bfloat16)
    first = w8_gemv(x, wq, ws)
    for _ in range(50):
        assert torch.equal(w8_gemv(x, wq, ws), first)
    for m in range(1, W8_GEMV_MAX_M + 1):
        w8_gemv(torch.randn(m, k, device=DEV, dtype=torch.bfloat16), wq, ws)
        w8_gemv(torch.randn(m, 2 * k, device=DEV, dtype=torch.bfloat16), wq, ws, gated=True)
        res = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
        w8_gemv(torch.randn(m, 2 * k, device=DEV, dtype=torch.bfloat16), wq, ws, gated=True,
                residual=res)
        w8_gemv(torch.randn(m, k, device=DEV, dtype=torch.bfloat16), wq, ws, residual=res)
    assert _compiled(_w8_gemv_kernel) == before


def test_dependent_launches_in_a_graph_give_plain_launches_bits(monkeypatch) -> None:
    """Kernels launched as programmatic dependents (sm_90+: each may be scheduled while the one
    before it finishes and waits for it on the GPU) give the bits of plain launches in a CUDA
    graph chain where every kernel reads what the one before it wrote."""
    from peregrine.kernels import _utils
    from peregrine.kernels.activation import silu_and_mul
    from peregrine.kernels.rmsnorm import rms_norm
    k, n = SHAPES["gate_up"]
    w_up, w_down = _layout(k, n, 4, zp=True), _layout(n // 2, k, 4, zp=True)
    norm_w = torch.rand(k, device=DEV, dtype=torch.bfloat16) + 0.5
    x = torch.empty(1, k, device=DEV, dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        h = rms_norm(x, norm_w, 1e-5)
        for _ in range(4):
            a = silu_and_mul(wna16_gemv(h, w_up))
            h = rms_norm(wna16_gemv(a, w_down), norm_w, 1e-5)
        return h

    def replays(flag: str) -> list[torch.Tensor]:
        monkeypatch.setenv("PEREGRINE_DEPENDENT_LAUNCH", flag)
        _utils._dependent_launch.cache_clear()
        assert _utils.pdl_args(x)["PDL"] == (flag == "1")
        x.normal_()
        chain()  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        outs, gen = [], torch.Generator(device=DEV).manual_seed(5)
        for _ in range(10):
            x.copy_(torch.randn(x.shape, generator=gen, device=DEV))
            graph.replay()
            outs.append(out.clone())
        return outs

    try:
        on, off = replays("1"), replays("0")
    finally:
        _utils._dependent_launch.cache_clear()
    assert all(torch.isfinite(o).all() for o in on)
    for a, b in zip(on, off):
        assert torch.equal(a, b)


@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_half2_variant_reads_6_bit_weights(shape: str, dtype: torch.dtype, zp: bool) -> None:
    """One row of 6-bit weights (RTN's layout: low nibbles in the 4-bit words, two high bits in
    a second plane) through the packed-half GEMV (the default where the tensor-core one does
    not run): within the fp16 sums' rounding of the exact result (as for 4 bits: q - zero < 64
    and x * 2^-8 exact in fp16, four products summed in fp16), its prefetching forms the same
    bits, gated inputs the activation kernel's output fed to it bit for bit."""
    from peregrine.kernels.activation import silu_and_mul
    from peregrine.kernels.wna16_gemv import _variant
    k, n = SHAPES[shape]
    w = _layout(k, n, 6, zp, dtype=dtype)
    x = torch.randn(1, k, device=DEV, dtype=dtype)
    assert _variant(w, x, None, None) == "tc"
    got = wna16_gemv(x, w, variant="half2_prefetch")
    assert _exact_err(got, x, w) <= 2.0
    assert torch.equal(wna16_gemv(x, w, variant="half2"), got)
    assert torch.equal(wna16_gemv(x, w, variant="half2_prefetch2"), got)
    if shape == "down":
        h = torch.randn(1, 2 * k, device=DEV, dtype=dtype) * 3
        assert torch.equal(wna16_gemv(h, w, variant="half2_prefetch", gated=True),
                           wna16_gemv(silu_and_mul(h), w, variant="half2_prefetch"))


def _fp8_exact_err(got: torch.Tensor, x: torch.Tensor, wq: torch.Tensor,
                   ws: torch.Tensor) -> float:
    """_exact_err for FP8 weights with per-channel scales."""
    want = x.float() @ (wq.float() * ws.reshape(-1, 1).float()).t()  # (M, N)
    unit = torch.maximum(want.abs(), want.pow(2).mean().sqrt()) * torch.finfo(x.dtype).eps
    return ((got.float() - want).abs() / unit).max().item()


@pytest.mark.parametrize("m", (1, 2, 3, 5, 8))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fp8_tc_gemv_within_an_output_ulp(shape: str, dtype: torch.dtype, m: int) -> None:
    """The FP8 tensor-core GEMV (1-8 rows, per-channel scales) within one output ulp of the exact
    x @ (W * scale)^T at every Llama-3-8B shape, with its default split and unsplit; bf16
    inputs beyond fp16's range stay finite and exact."""
    from peregrine.kernels.gemv import GemvConfig
    from peregrine.kernels.w8_gemv_tc import fp8_tc_supported, w8_gemv_tc
    k, n = SHAPES[shape]
    wq, ws = fp8_pack.quantize_per_channel(torch.randn(n, k, device=DEV) * 0.02, FP8_DTYPE)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    assert fp8_tc_supported(x, wq, ws)
    got = w8_gemv_tc(x, wq, ws)
    assert got.shape == (m, n) and _fp8_exact_err(got, x, wq, ws) <= 1.0
    one = GemvConfig(32, 64, 1, k // 64, 1)
    assert _fp8_exact_err(w8_gemv_tc(x, wq, ws, one), x, wq, ws) <= 1.0
    if dtype == torch.bfloat16 and shape == "o":
        big = (x.float() * 1e5).to(dtype)
        assert _fp8_exact_err(w8_gemv_tc(big, wq, ws), big, wq, ws) <= 1.0


@pytest.mark.parametrize("block", [(128, 128), (32, 64), (64, 256)], ids=str)
@pytest.mark.parametrize("m", (1, 3, 8))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fp8_tc_gemv_with_block_scales_within_an_output_ulp(shape: str, m: int,
                                                            block: tuple[int, int]) -> None:
    """Block-scaled FP8 weights (each K block's sums times its scale): within one output ulp of
    the exact x @ block_dequant(W)^T, with the default split and unsplit."""
    from peregrine.kernels.gemv import GemvConfig
    from peregrine.kernels.w8_gemv_tc import fp8_tc_supported, w8_gemv_tc
    k, n = SHAPES[shape]
    wq, ws = fp8_pack.quantize_blocks(torch.randn(n, k, device=DEV) * 0.02, block)
    ws = ws * torch.rand_like(ws)  # scales unlike each other, so a wrong block shows
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    assert fp8_tc_supported(x, wq, ws, block) and not fp8_tc_supported(x, wq, ws)
    want = x.float() @ block_dequantize(wq, ws, block).t()
    unit = torch.maximum(want.abs(), want.pow(2).mean().sqrt()) * torch.finfo(x.dtype).eps
    for cfg in (None, GemvConfig(32, 64, 1, k // 64, 1)):
        got = w8_gemv_tc(x, wq, ws, cfg, block=block)
        assert got.shape == (m, n) and ((got.float() - want).abs() / unit).max().item() <= 1.0


@pytest.mark.parametrize("m", (1, 3, 8))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_int8_tc_gemv_within_an_output_ulp(shape: str, dtype: torch.dtype, m: int) -> None:
    """int8 weights (per channel) through the same tensor-core GEMV: within one output ulp of
    the exact x @ (W * scale)^T, split and unsplit; apply_int8_linear takes it at 2-8 rows."""
    from peregrine.kernels.gemv import GemvConfig
    from peregrine.kernels.w8_gemv_tc import fp8_tc_supported, w8_gemv_tc
    from peregrine.layers.quantization.fp8 import TC_GEMV_MAX_M, TC_GEMV_MIN_M
    k, n = SHAPES[shape]
    wq, ws = fp8_pack.quantize_per_channel(torch.randn(n, k, device=DEV) * 0.02, torch.int8)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    assert fp8_tc_supported(x, wq, ws)
    for cfg in (None, GemvConfig(32, 64, 1, k // 64, 1)):
        got = w8_gemv_tc(x, wq, ws, cfg)
        assert got.shape == (m, n) and _fp8_exact_err(got, x, wq, ws) <= 1.0
    if TC_GEMV_MIN_M <= m <= TC_GEMV_MAX_M:
        assert torch.equal(apply_int8_linear(x, wq, ws.t().contiguous(), None, None),
                           w8_gemv_tc(x, wq, ws))


def test_fp8_tc_gemv_replays_in_a_graph_and_repeats_bit_for_bit() -> None:
    from peregrine.kernels.w8_gemv_tc import w8_gemv_tc
    k, n = SHAPES["qkv"]
    wq, ws = fp8_pack.quantize_per_channel(torch.randn(n, k, device=DEV) * 0.02, FP8_DTYPE)
    x = torch.randn(4, k, device=DEV, dtype=torch.bfloat16)
    first = w8_gemv_tc(x, wq, ws)
    assert torch.equal(w8_gemv_tc(x, wq, ws), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w8_gemv_tc(x, wq, ws)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, w8_gemv_tc(x, wq, ws))


@pytest.mark.parametrize("block", [None, (128, 128), "int8"], ids=["channel", "block", "int8"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fp8_decode_rows_compile_nothing_after_load(shape: str, block) -> None:
    """The 8-bit methods' load-time precompile covers every decode row count: 1-8 rows (the
    8-bit GEMV, then the tensor-core GEMV), the gated down form and, for gate/up, the one-row
    form that normalises its input and writes the activation compile no kernel afterwards (FP8
    per channel and in blocks, int8)."""
    _needs_fp8()
    from peregrine.kernels.gemv import _w8_gemv_kernel
    from peregrine.kernels.w8_gemv_tc import w8_gemv_tc_kernel
    from peregrine.layers.quantization.fp8 import (TC_GEMV_MAX_M, Fp8W8A8Method,
                                                   apply_w8_rms_normed_silu_and_mul,
                                                   apply_w8_silu_and_mul)
    from peregrine.layers.quantization.int8 import Int8W8A8Method
    k, n = SHAPES[shape]
    w = torch.randn(n, k, device=DEV) * 0.02
    if block is None or block == "int8":
        int8 = block == "int8"
        block = None
        wq, ws = fp8_pack.quantize_per_channel(w, torch.int8 if int8 else FP8_DTYPE)
        layer = SimpleNamespace(weight=wq, weight_scale=torch.nn.Parameter(ws),
                                input_scale=None, is_equal_pair=shape == "gate_up")
        method = Int8W8A8Method() if int8 else Fp8W8A8Method()
        method.act_dtype = torch.bfloat16
    else:
        wq, ws = fp8_pack.quantize_blocks(w, block)
        layer = SimpleNamespace(weight=wq, weight_scale_inv=ws, is_equal_pair=shape == "gate_up")
        method = Fp8BlockMethod(block)
        method.act_dtype = torch.bfloat16
    method.process_weights_after_loading(layer)  # precompiles
    scale = layer.weight_scale if block is None else ws
    before = _compiled(_w8_gemv_kernel) + _compiled(w8_gemv_tc_kernel)
    assert TC_GEMV_MAX_M == 8 and _compiled(w8_gemv_tc_kernel) > 0
    for m in range(1, 9):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        assert method.apply(layer, x).shape == (m, n)
        h = torch.randn(m, 2 * k, device=DEV, dtype=torch.bfloat16)
        apply_w8_silu_and_mul(h, wq, scale, block, None)
    if shape == "gate_up" and block is None:  # (block scales: one row is the tensor-core GEMV's)
        nw = torch.ones(k, device=DEV, dtype=torch.bfloat16)
        a = apply_w8_rms_normed_silu_and_mul(torch.randn(1, k, device=DEV, dtype=torch.bfloat16),
                                             wq, scale, None, nw, 1e-5)
        assert a is not None and a.shape == (1, n // 2)
    assert _compiled(_w8_gemv_kernel) + _compiled(w8_gemv_tc_kernel) == before
