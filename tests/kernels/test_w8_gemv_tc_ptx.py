"""The FP8 tensor-core GEMV's inline PTX (kernels/w8_gemv_tc.py; Gluon, GPU only) run here on the
CPU by the warp emulator of test_wna16_gemv_tc_ptx.py: one warp's program (V = 2: 32 channels)
over the weight bytes and inputs each lane reads in the kernel gives x @ (W * scale)^T to
float32 rounding at one row and at several, bf16 x (scaled into fp16 by 2^-8 and back) and
fp16 x: this checks the e4m3 pairs' order, the B pairs, which C register holds which channel
and row, and the scaling."""
from __future__ import annotations

import pytest
import torch

from peregrine.kernels import w8_gemv_tc as tc
from test_wna16_gemv_tc_ptx import _f32, _words, run_warp

V = 2


def _bytes_words(row: torch.Tensor) -> list[int]:
    """FP8 bytes as int32 words (the first byte lowest)."""
    return [int(v) & 0xFFFFFFFF for v in row.contiguous().view(torch.int32).tolist()]


def _warp_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, rows: int,
               tile: str | None = None) -> torch.Tensor:
    """The kernel's one-warp program for x (M, K) and FP8 w (32, K): ROWS = 1 (every column row
    0) or more; lane 4g + t's channel i is 2Vg + i (M-tile i's row g for i < V, tile i - V's row
    g + 8 above)."""
    tile = tile or tc._TILE.value
    bf16 = x.dtype == torch.bfloat16
    m, k = x.shape
    zero = 0
    acc = [[[zero] * 4 for _ in range(V)] for _ in range(32)]
    for st in range(k // tc.STEP):
        b = []
        for lane in range(32):  # the lane's B pairs: its row of x, inputs 16t..16t + 15
            g, t = lane // 4, lane % 4
            row = 0 if rows == 1 else min(g, m - 1)
            k0 = st * tc.STEP + 16 * t
            xw = _words(x[row, k0:k0 + 16])
            if bf16:
                xw = [run_warp(tc._X_BF16.value, [{4 + j: xw[4 * h + j] for j in range(4)}],
                               "f16")[0][j] for h in range(2) for j in range(4)]
            b.append(xw)
        for i in range(V):
            ops = []
            for lane in range(32):
                g, t = lane // 4, lane % 4
                k0 = st * tc.STEP + 16 * t
                wg = _bytes_words(w[2 * V * g + i, k0:k0 + 16])
                wh = _bytes_words(w[2 * V * g + V + i, k0:k0 + 16])
                ops.append({**{4 + j: wg[j] for j in range(4)}, **{8 + j: wh[j] for j in range(4)},
                            **{12 + j: b[lane][j] for j in range(8)},
                            **{20 + j: acc[lane][i][j] for j in range(4)}})
            for lane, out in enumerate(run_warp(tile, ops, "f16")):
                acc[lane][i] = [out[j] for j in range(4)]
    y = torch.zeros(m, 32, dtype=torch.float64)
    unscale = 256.0 if bf16 else 1.0
    for lane in range(32):  # the epilogue, float32 as in _scaled
        g, t = lane // 4, lane % 4
        for r in (0, 1):
            row = 0 if rows == 1 else 2 * t + r
            if row >= m or (rows == 1 and (t or r)):
                continue
            for i in range(V):
                for ch, reg in ((2 * V * g + i, r), (2 * V * g + V + i, 2 + r)):
                    a = torch.tensor(_f32(acc[lane][i][reg]), dtype=torch.float32)
                    y[row, ch] = (a * (scale[ch].float() * unscale)).item()
    return y


def _case(m: int, dtype: torch.dtype, seed: int, k: int = 256, int8: bool = False):
    gen = torch.Generator().manual_seed(seed)
    if int8:
        w = torch.randint(-128, 128, (32, k), generator=gen, dtype=torch.int8)
        w[0, :4] = torch.tensor([-128, 127, 0, -1], dtype=torch.int8)
    else:
        w = (torch.randn(32, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        w[0, :7] = torch.tensor([0.0, -0.0, 2.0 ** -9, -(2.0 ** -8), 448.0, -448.0, 2.0 ** -6])
    scale = torch.rand(32, generator=gen) * 0.01 + 0.001
    x = torch.randn(m, k, generator=gen).to(dtype)
    want = x.double() @ (w.double() * scale.double()[:, None]).t()
    return x, w, scale, want


@pytest.mark.parametrize("int8", [False, True], ids=["fp8", "int8"])
@pytest.mark.parametrize("rows, m, dtype", [(1, 1, torch.bfloat16), (1, 1, torch.float16),
                                            (8, 3, torch.bfloat16), (8, 8, torch.float16)])
def test_one_warp_gives_the_exact_product(rows: int, m: int, dtype: torch.dtype,
                                          int8: bool) -> None:
    """FP8 weights, and int8 ones (bytes -> fp16 pairs by xor, prmt under 1024's exponent and a
    packed subtraction of 1152: exact for every value, -128 and 127 included)."""
    x, w, scale, want = _case(m, dtype, seed=21 if int8 else 11, int8=int8)
    got = _warp_gemv(x, w, scale, rows, tile=tc._TILE_I8.value if int8 else tc._TILE.value)
    rms = want.pow(2).mean().sqrt().item()
    # NOTE: exact fp16 weights and inputs (bf16 x * 2^-8 is exact in fp16 above 2^-6, and the
    # error below it is at most 2^-17 absolute), float32 sums: far below a 16-bit output's ulp.
    assert (got - want).abs().max().item() <= 1e-4 * rms
    assert want.abs().max().item() > 0.1 * rms


def test_large_bf16_inputs_do_not_overflow_fp16() -> None:
    """bf16 inputs past fp16's range (65504) still give the product: they enter fp16 scaled by
    2^-8."""
    x, w, scale, _ = _case(1, torch.bfloat16, seed=12)
    x = (x.float() * 3e4).to(torch.bfloat16)  # up to ~1e5
    want = x.double() @ (w.double() * scale.double()[:, None]).t()
    got = _warp_gemv(x, w, scale, 1)
    assert x.abs().max().item() > 65504
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= 1e-4 * want.pow(2).mean().sqrt().item()


def test_an_int8_offset_off_by_one_is_caught() -> None:
    """The check above can fail: 1151 taken off instead of 1152 (every weight one too large)."""
    x, w, scale, want = _case(1, torch.float16, seed=22, int8=True)
    bad = tc._TILE_I8.value.replace("0x64806480", "0x647F647F")
    assert bad != tc._TILE_I8.value
    got = _warp_gemv(x, w, scale, 1, tile=bad)
    assert (got - want).abs().max().item() > 1e-2 * want.pow(2).mean().sqrt().item()


def test_swapped_fp8_halves_are_caught() -> None:
    """The check above can fail: a word's e4m3 halves fed to the wrong A registers."""
    x, w, scale, want = _case(1, torch.bfloat16, seed=13)
    bad = tc._TILE.value.replace("cvt.rn.f16x2.e4m3x2 a2, ghi;", "cvt.rn.f16x2.e4m3x2 a2, glo;")
    assert bad != tc._TILE.value
    got = _warp_gemv(x, w, scale, 1, tile=bad)
    assert (got - want).abs().max().item() > 1e-2 * want.pow(2).mean().sqrt().item()


def test_the_launch_rules() -> None:
    """K splits into whole chunks of 256 inputs (4 steps, the unrolled loop); inputs the kernel
    does not take are refused with the reason."""
    cpu = torch.device("cpu")
    room = tc._RESIDENT_WARPS // tc._WARPS * 8  # programs in one wave on the CPU's 8 "SMs"
    for n, k in ((6144, 4096), (4096, 14336), (28672, 4096), (64, 256), (256, 2048)):
        cfg = tc.fp8_tc_config(n, k, cpu)
        assert cfg.split_k * cfg.k_iters * tc.STEP == k and cfg.k_iters % 4 == 0
        assert cfg.block_n == 16 * tc._V * cfg.num_warps
        tiles, chunks = -(-n // cfg.block_n), k // tc.CHUNK
        fits = [s for s in range(1, chunks + 1) if chunks % s == 0 and tiles * s <= room]
        assert cfg.split_k == max(fits, default=1)  # the largest split of one wave
    assert tc.fp8_tc_config(256, 2048, cpu).split_k == 8  # 8 tiles x 8 splits <= 96
    w = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    assert not tc.fp8_tc_supported(x, w, torch.ones(64))  # a CPU tensor
    with pytest.raises(ValueError, match="w8_gemv_tc: takes 1-8 rows of 16-bit x"):
        tc.w8_gemv_tc(x, w, torch.ones(64))


def test_block_scales_the_kernel_reads() -> None:
    """Block scales: float32 (N / bn, K / bk) row-major, bk 64, 128 or 256 inputs (whole steps of
    a chunk), bn a multiple of a program's channels; anything else is not taken."""
    n, k = 256, 1024
    ok = torch.ones(2, 8)  # (256 / 128, 1024 / 128)
    assert tc._block_ok(n, k, ok, (128, 128))
    assert tc._block_ok(n, k, torch.ones(8, 4), (32, 256))
    assert tc._block_ok(n, k, torch.ones(n), None)
    assert not tc._block_ok(n, k, ok.double(), (128, 128))  # not float32
    assert not tc._block_ok(n, k, ok.t().contiguous().t(), (128, 128))  # not row-major
    assert not tc._block_ok(n, k, torch.ones(2, 4), (128, 256 + 128))  # bk not a step multiple
    assert not tc._block_ok(n, k, torch.ones(16, 8), (16, 128))  # bn below a program's channels
    assert not tc._block_ok(n, k, torch.ones(2, 4), (128, 128))  # the wrong shape
