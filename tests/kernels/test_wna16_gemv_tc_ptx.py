"""The tensor-core GEMV's inline PTX (kernels/wna16_gemv_tc.py; Gluon, GPU only) run here on the
CPU: a warp of 32 lanes executes the kernel's asm strings instruction by instruction, the MMA
as PTX defines its m16n8k16 fragments, over the words, inputs, scales and zero points each lane
reads in the kernel (its channels, word rows and row of x). One warp's program over two groups
then gives x @ dequant(W) to float32 rounding, at one row and at several: this checks the pair
order, the B pairs, which C register holds which channel and row, and the zero point taken out
once a group as scale * (acc - (magic + zero) * sum(x))."""
from __future__ import annotations

import pytest
import torch

from peregrine.kernels import wna16_gemv_tc as tc
from peregrine.layers.quantization.wna16 import WNA16Layout
from test_wna16_dequant_ptx import (MASK, _bits16, _bits32, _f32, _half, _lop3, _prmt,
                                    _sub_x2)

KIND = {torch.bfloat16: "bf16", torch.float16: "f16"}


def _operands(line: str) -> list[str]:
    """The comma-separated operands of an instruction, braces kept together."""
    out, depth, cur = [], 0, ""
    for ch in line:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()]


def _mma(lanes: list[dict[str, int]], d: list[str], a: list[str], b: list[str], c: list[str],
         kind: str) -> None:
    """mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 across the warp: lane 4g + t
    holds A[g][2t..], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..] (two 16-bit values each),
    B[2t..][g], B[2t+8..][g], and C/D [g][2t], [g][2t+1], [g+8][2t], [g+8][2t+1]."""
    A = torch.zeros(16, 16, dtype=torch.float64)
    B = torch.zeros(16, 8, dtype=torch.float64)
    C = torch.zeros(16, 8, dtype=torch.float64)
    for lane, regs in enumerate(lanes):
        g, t = lane // 4, lane % 4
        for r, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                        (g + 8, 2 * t + 8))):
            v = regs[a[r]]
            A[row, col], A[row, col + 1] = _half(v & 0xFFFF, kind), _half(v >> 16, kind)
        for r, k in enumerate((2 * t, 2 * t + 8)):
            v = regs[b[r]]
            B[k, g], B[k + 1, g] = _half(v & 0xFFFF, kind), _half(v >> 16, kind)
        for r, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t),
                                        (g + 8, 2 * t + 1))):
            C[row, col] = _f32(regs[c[r]])
    D = (A @ B + C).float()
    for lane, regs in enumerate(lanes):
        g, t = lane // 4, lane % 4
        for r, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t),
                                        (g + 8, 2 * t + 1))):
            regs[d[r]] = _bits32(D[row, col].item())


def run_warp(asm: str, operands: list[dict[int, int]], kind: str) -> list[dict[int, int]]:
    """Executes `asm` on 32 lanes (operands[lane]: $n -> value); returns every lane's $n."""
    lanes = [{f"${k}": v & MASK for k, v in ops.items()} for ops in operands]

    def val(regs: dict[str, int], tok: str) -> int:
        if tok in regs:
            return regs[tok]
        if tok.startswith("0f"):  # a float32 immediate by its bits
            return int(tok[2:], 16)
        return int(tok, 0) & MASK

    for line in asm.replace("{\n", "\n").split(";"):
        line = line.strip().strip("}").strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = _operands(rest)
        if op.startswith("mma.sync.aligned.m16n8k16.row.col.f32"):
            d, a, b, c = ([x.strip() for x in arg.strip("{}").split(",")] for arg in args)
            _mma(lanes, d, a, b, c, kind)
            continue
        if op == "mov.b32" and args[0].startswith("{"):  # a 32-bit word into two 16-bit regs
            lo, hi = (x.strip() for x in args[0].strip("{}").split(","))
            for regs in lanes:
                v = val(regs, args[1])
                regs[lo], regs[hi] = v & 0xFFFF, v >> 16
            continue
        for regs in lanes:
            dst, src = args[0], [val(regs, x) for x in args[1:]]
            if op == "cvt.rn.f16x2.e4m3x2":  # two e4m3 bytes (low first) as an fp16 pair
                regs[dst] = _fp8_pair(src[0])
                continue
            if op in ("cvt.rn.f16x2.f32", "cvt.rn.satfinite.f16x2.f32"):
                # d = (f16(a) high, f16(b) low), nearest even (satfinite: within +-65504)
                a, b = _f32(src[0]), _f32(src[1])
                if "satfinite" in op:
                    a, b = (max(-65504.0, min(65504.0, v)) for v in (a, b))
                regs[dst] = (_bits16(a, "f16") << 16) | _bits16(b, "f16")
                continue
            if op == "mul.f32":
                regs[dst] = _bits32((torch.tensor(_f32(src[0]), dtype=torch.float32)
                                     * torch.tensor(_f32(src[1]), dtype=torch.float32)).item())
                continue
            if op == "sub.f16x2":
                regs[dst] = _sub_x2(src[0], src[1], "f16")
                continue
            if op == "sub.f32":
                regs[dst] = _bits32((torch.tensor(_f32(src[0]), dtype=torch.float32)
                                     - torch.tensor(_f32(src[1]), dtype=torch.float32)).item())
                continue
            if op == "xor.b32":
                regs[dst] = src[0] ^ src[1]
                continue
            if op == "and.b32":
                regs[dst] = src[0] & src[1]
                continue
            if op == "lop3.b32":
                regs[dst] = _lop3(*src)
            elif op == "shr.u32":
                regs[dst] = src[0] >> src[1]
            elif op == "shl.b32":
                regs[dst] = (src[0] << src[1]) & MASK
            elif op == "mov.b32":
                regs[dst] = src[0]
            elif op == "prmt.b32":
                regs[dst] = _prmt(*src)
            else:
                raise AssertionError(f"the emulator does not know {op!r}")
    return [{int(k[1:]): v for k, v in regs.items() if k.startswith("$")} for regs in lanes]


def _fp8_pair(v: int) -> int:
    """Two e4m3 bytes (the low one first) as fp16 bits (exact: fp16 holds every e4m3 value)."""
    b = torch.tensor([v & 0xFF, (v >> 8) & 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn)
    h = b.to(torch.float16).view(torch.int16).tolist()
    return (h[0] & 0xFFFF) | ((h[1] & 0xFFFF) << 16)


def _words(t: torch.Tensor) -> list[int]:
    """A 16-bit tensor's values, two to an int32 (the first in the low half)."""
    return [int(v) & MASK for v in t.contiguous().view(torch.int32).tolist()]


def _warp_gemv(x: torch.Tensor, w: WNA16Layout, rows: int) -> torch.Tensor:
    """The kernel's one-warp program (V = 2: 16 channels of M-tiles 0 and 1 x rows g, g + 8 =
    32 channels, every group of K) for x (M, K), ROWS = 1 (every column row 0) or more."""
    kind = KIND[x.dtype]
    magic = 128.0 if kind == "bf16" else 1024.0
    six = w.bits == 6
    tile, pairs, sums = ((tc._TILE_BF16, tc._PAIRS, tc._SUM_BF16) if kind == "bf16"
                         else (tc._TILE_F16, tc._PAIRS, tc._SUM_F16))
    if six:
        tile = tc._TILE6_BF16 if kind == "bf16" else tc._TILE6_F16
    ones = 0x3F803F80 if kind == "bf16" else 0x3C003C00
    V, (m, k) = 2, x.shape
    q = w.qweight
    y = torch.zeros(m, 32, dtype=torch.float64)
    zero = _bits32(0.0)
    for c in range(k // 128):
        grp = c * 128 // w.group_size
        acc = [[[zero] * 4 for _ in range(V)] for _ in range(32)]  # lane, M-tile, C register
        cx = [[zero] * 4 for _ in range(32)]
        for s in range(4):
            b = []
            for lane in range(32):  # the lane's B pairs: its row of x, its word row's 8 inputs
                g, t = lane // 4, lane % 4
                row = 0 if rows == 1 else min(g, m - 1)
                r = 16 * c + 4 * s + t
                xw = _words(x[row, 8 * r:8 * r + 8])
                out = run_warp(pairs.value, [{4: xw[0], 5: xw[1], 6: xw[2], 7: xw[3]}],
                               kind)[0]
                b.append([out[i] for i in range(4)])
            for i in range(V):
                ops = []
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    r = 16 * c + 4 * s + t
                    lo, hi = 4 * g + i, 4 * g + V + i
                    if six:  # the second plane's words and the lane's half of them
                        hq = w.qweight_hi
                        ops.append({4: int(q[r, lo]), 5: int(q[r, hi]), 6: int(hq[r // 2, lo]),
                                    7: int(hq[r // 2, hi]), 8: 0x4342 if t % 2 else 0x4140,
                                    **{9 + j: b[lane][j] for j in range(4)},
                                    **{13 + j: acc[lane][i][j] for j in range(4)}})
                        continue
                    ops.append({4: int(q[r, lo]), 5: int(q[r, hi]),
                                **{6 + j: b[lane][j] for j in range(4)},
                                **{10 + j: acc[lane][i][j] for j in range(4)}})
                for lane, out in enumerate(run_warp(tile.value, ops, kind)):
                    acc[lane][i] = [out[j] for j in range(4)]
            ops = [{4: ones, **{5 + j: b[lane][j] for j in range(4)},
                    **{9 + j: cx[lane][j] for j in range(4)}} for lane in range(32)]
            for lane, out in enumerate(run_warp(sums.value, ops, kind)):
                cx[lane] = [out[j] for j in range(4)]
        for lane in range(32):  # the group's fix-up, float32 as in _fix
            g, t = lane // 4, lane % 4
            for r_ in (0, 1):
                row = 0 if rows == 1 else 2 * t + r_
                if row >= m or (rows == 1 and (t or r_)):
                    continue
                xs = torch.tensor(_f32(cx[lane][r_]), dtype=torch.float32)
                for i in range(V):
                    for ch, reg in ((4 * g + i, r_), (4 * g + V + i, 2 + r_)):
                        sc = w.scales[grp, ch].float()
                        zc = (w.zeros[grp, ch].float() if w.zeros is not None
                              else torch.tensor(32.0 if six else 8.0)) + magic
                        a = torch.tensor(_f32(acc[lane][i][reg]), dtype=torch.float32)
                        y[row, ch] += (sc * (a - zc * xs)).item()
    return y


@pytest.mark.parametrize("rows, m, dtype, zp, bits", [(1, 1, torch.bfloat16, True, 4),
                                                      (1, 1, torch.float16, False, 4),
                                                      (8, 3, torch.bfloat16, True, 4),
                                                      (1, 1, torch.bfloat16, False, 6),
                                                      (8, 5, torch.float16, True, 6)])
def test_one_warp_gives_the_exact_product(rows: int, m: int, dtype: torch.dtype, zp: bool,
                                          bits: int) -> None:
    gen = torch.Generator().manual_seed(7)
    k, n = 256, 32
    qv = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int32)
    scales = torch.rand(k // 128, n, generator=gen) * 0.01 + 0.002
    zeros = torch.randint(0, 1 << bits, (k // 128, n), generator=gen).float() if zp else None
    w = WNA16Layout.build(qv, scales, zeros, None, bits, dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    got = _warp_gemv(x, w, rows)
    want = x.double() @ w.dequantize(torch.float64).t()
    rms = want.pow(2).mean().sqrt().item()
    # NOTE: float32 sums of (magic + q) * x less (magic + zero) * sum(x): what cancels is ~1e-7 of
    # 128 (bf16) or 1024 (fp16) times the inputs' sum, far below a 16-bit output's ulp (4e-3 / 5e-4).
    assert (got - want).abs().max().item() <= 1e-4 * rms
    # NOTE: a wrong pair order or register would be off by the size of the product itself.
    assert (got - want).abs().max().item() < 0.01 * (want.abs().max().item())
    assert want.abs().max().item() > 0.1 * rms


def test_a_swapped_b_pair_is_caught() -> None:
    """The check above can fail: the B pairs in the wrong order give the wrong product."""
    gen = torch.Generator().manual_seed(8)
    k, n = 256, 32
    w = WNA16Layout.build(torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32),
                          torch.rand(2, n, generator=gen) * 0.01 + 0.002, None, None, 4,
                          torch.bfloat16)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    want = x.double() @ w.dequantize(torch.float64).t()
    pairs = tc._PAIRS
    try:
        tc._PAIRS = type(pairs)(pairs.value.replace("0x5410", "0x1054"))
        got = _warp_gemv(x, w, 1)
    finally:
        tc._PAIRS = pairs
    assert (got - want).abs().max().item() > 1e-2 * want.pow(2).mean().sqrt().item()
