"""The persistent decode kernel's fp16-operand form (kernels/ring_gemv.py, F16; Gluon, GPU only)
run here on the CPU: x's bf16 rows rewritten as fp16 B pairs, the weights' values decoded with
two magics (1024 for the values at bits 0-3 of a half word, 64 for those at bits 4-7), the sums
of magic-weighted and plain inputs from one constant-weight MMA, and the group's fix-up
scale * (acc - sum(magic_k x_k) - zero * sum(x)); one warp over two groups against
x @ dequant(W)."""
from __future__ import annotations

import torch

from peregrine.kernels import ring_gemv as rg
from peregrine.layers.quantization.wna16 import WNA16Layout
from test_wna16_dequant_ptx import _f32, _half
from test_wna16_gemv_tc_ptx import _words, run_warp


def _warp_gemv_f16(x: torch.Tensor, w: WNA16Layout, pairs: str = rg._F16_PAIRS.value
                   ) -> torch.Tensor:
    """One warp's program in the F16 form (one row of x; 32 channels: lane 4g + t holds
    channels 4g .. 4g + 3 of its word row 4s + t, M-tile i rows g = channel 4g + i, rows g + 8
    = channel 4g + 2 + i) over every group of K."""
    k = x.shape[1]
    q = w.qweight
    y = torch.zeros(32, dtype=torch.float64)
    zero = 0
    for c in range(k // 128):
        acc = [[[zero] * 4 for _ in range(2)] for _ in range(32)]  # lane, M-tile, C register
        cx = [[zero] * 4 for _ in range(32)]
        for s in range(4):
            b = []
            for lane in range(32):  # the row's fp16 B pairs, as _x_to_smem leaves them
                r = 16 * c + 4 * s + lane % 4
                xw = _words(x[0, 8 * r:8 * r + 8])
                out = run_warp(pairs, [{4: xw[0], 5: xw[1], 6: xw[2], 7: xw[3]}], "f16")[0]
                b.append([out[i] for i in range(4)])
            for i in range(2):
                ops = []
                for lane in range(32):
                    g, r = lane // 4, 16 * c + 4 * s + lane % 4
                    ops.append({4: int(q[r, 4 * g + i]), 5: int(q[r, 4 * g + 2 + i]),
                                **{6 + j: b[lane][j] for j in range(4)},
                                **{10 + j: acc[lane][i][j] for j in range(4)}})
                for lane, out in enumerate(run_warp(rg._TILE_F16.value, ops, "f16")):
                    acc[lane][i] = [out[j] for j in range(4)]
            ops = [{**{4 + j: b[lane][j] for j in range(4)},
                    **{8 + j: cx[lane][j] for j in range(4)}} for lane in range(32)]
            for lane, out in enumerate(run_warp(rg._SUM_F16.value, ops, "f16")):
                cx[lane] = [out[j] for j in range(4)]
        f32 = torch.float32
        for lane in range(0, 32, 4):  # lane t = 0 holds column 0 (x's row)
            g = lane // 4
            m = torch.tensor(_f32(cx[lane][0]), dtype=f32)
            xs = torch.tensor(_f32(cx[lane][2]), dtype=f32)
            for i in range(2):
                for ch, reg in ((4 * g + i, 0), (4 * g + 2 + i, 2)):
                    sc, zp = w.scales[c, ch].float(), w.zeros[c, ch].float()
                    a = torch.tensor(_f32(acc[lane][i][reg]), dtype=f32)
                    y[ch] += (sc * (a - m - zp * xs)).item()
    return y


def _case(seed: int, scale: float = 1.0) -> tuple[torch.Tensor, WNA16Layout]:
    gen = torch.Generator().manual_seed(seed)
    k, n = 256, 32
    qv = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    scales = torch.rand(k // 128, n, generator=gen) * 0.01 + 0.002
    zeros = torch.randint(0, 16, (k // 128, n), generator=gen).float()
    w = WNA16Layout.build(qv, scales, zeros, None, 4, torch.bfloat16)
    return (torch.randn(1, k, generator=gen) * scale).to(torch.bfloat16), w


def test_one_warp_gives_the_exact_product() -> None:
    x, w = _case(11)
    got = _warp_gemv_f16(x, w)
    want = (x.double() @ w.dequantize(torch.float64).t())[0]
    rms = want.pow(2).mean().sqrt().item()
    # NOTE: bf16 inputs are exact in fp16 at this range; what the float32 sums lose is ~1e-7
    # of 1024 times the inputs' sum, far below a bf16 output's ulp (4e-3).
    assert (got - want).abs().max().item() <= 1e-4 * rms
    assert want.abs().max().item() > 0.1 * rms


def test_a_wrong_pair_order_is_caught() -> None:
    """The check above can fail: x's pairs in the plain order give the wrong product."""
    x, w = _case(12)
    want = (x.double() @ w.dequantize(torch.float64).t())[0]
    plain = rg._F16_PAIRS.value.replace("$0, a4, a0", "$0, a1, a0").replace(
        "$1, a5, a1", "$1, a3, a2").replace("$2, a6, a2", "$2, a5, a4").replace(
        "$3, a7, a3", "$3, a7, a6")
    got = _warp_gemv_f16(x, w, plain)
    assert (got - want).abs().max().item() > 1e-2 * want.pow(2).mean().sqrt().item()


def test_inputs_beyond_fp16_are_clamped_to_its_largest_value() -> None:
    x = torch.tensor([1e5, -3e5, 1.5, 65504.0, 7e4, -2.0, 0.25, 1e-3], dtype=torch.bfloat16)
    xw = _words(x)
    out = run_warp(rg._F16_PAIRS.value, [{4: xw[0], 5: xw[1], 6: xw[2], 7: xw[3]}], "f16")[0]
    vals = [_half(out[p] >> (16 * h) & 0xFFFF, "f16") for p in range(4) for h in (0, 1)]
    # pairs (x0 x4), (x1 x5), (x2 x6), (x3 x7), low half first
    want = [65504.0, 65504.0, -65504.0, -2.0, 1.5, 0.25, 65504.0, float(x[7].to(torch.float16))]
    assert vals == want
