"""The mma GEMV's inline-PTX dequantization (it only runs compiled, on a GPU), executed here
instruction by instruction by a small emulator of the PTX it uses: every asm gives q - zero of each
value of a word, exactly, in the order the plain-Triton path (the interpreter's) gives them, which
is the order the kernel loads x in."""
from __future__ import annotations

import re

import pytest
import torch
import triton
import triton.language as tl

from peregrine.kernels import wna16_gemv_mma as g
from peregrine.kernels.wna16_gemv_mma import _dequant_tile

MASK = 0xFFFFFFFF
_F16 = {"bf16": torch.bfloat16, "f16": torch.float16}


def _half(bits: int, kind: str) -> float:
    return torch.tensor([bits - (1 << 16) if bits >> 15 else bits], dtype=torch.int16).view(
        _F16[kind]).item()


def _bits16(v: float, kind: str) -> int:
    return torch.tensor([v], dtype=_F16[kind]).view(torch.int16).item() & 0xFFFF


def _f32(bits: int) -> float:
    return torch.tensor([bits - (1 << 32) if bits >> 31 else bits], dtype=torch.int32).view(
        torch.float32).item()


def _bits32(v: float) -> int:
    return torch.tensor([v], dtype=torch.float32).view(torch.int32).item() & MASK


def _prmt(a: int, b: int, sel: int) -> int:
    """Default-mode prmt: result byte i is byte (sel >> 4i) & 7 of {b, a} (a = bytes 0-3)."""
    pool = a | (b << 32)
    out = 0
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        assert s < 8, "sign-replicating selectors are not emulated"
        out |= ((pool >> (8 * s)) & 0xFF) << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for i in range(32):
        idx = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)
        out |= ((lut >> idx) & 1) << i
    return out


def _sub_x2(a: int, b: int, kind: str) -> int:
    lo = _bits16(_half(a & 0xFFFF, kind) - _half(b & 0xFFFF, kind), kind)
    hi = _bits16(_half(a >> 16, kind) - _half(b >> 16, kind), kind)
    return lo | (hi << 16)


def run_ptx(asm: str, operands: dict[int, int]) -> dict[int, int]:
    """Executes `asm` (the subset the kernels use) on the inputs; returns every $n it wrote."""
    regs = {f"${k}": v & MASK for k, v in operands.items()}

    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0) & MASK

    for line in asm.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        m = re.match(r"\{\s*(\S+)\s*,\s*(\S+)\s*\}\s*,\s*(\S+)$", rest)
        if op == "mov.b32" and m:  # split a 32-bit register into two 16-bit halves
            v = val(m.group(3))
            regs[m.group(1)], regs[m.group(2)] = v & 0xFFFF, v >> 16
            continue
        d, *src = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            regs[d] = val(src[0])
        elif op == "shr.u32":
            regs[d] = val(src[0]) >> val(src[1])
        elif op == "lop3.b32":
            regs[d] = _lop3(val(src[0]), val(src[1]), val(src[2]), val(src[3]))
        elif op == "prmt.b32":
            regs[d] = _prmt(val(src[0]), val(src[1]), val(src[2]))
        elif op in ("sub.bf16x2", "sub.f16x2"):
            regs[d] = _sub_x2(val(src[0]), val(src[1]), op[4:-2])
        elif op == "sub.f32":
            regs[d] = _bits32(_f32(val(src[0])) - _f32(val(src[1])))
        else:
            raise AssertionError(f"the emulator does not know {op!r}")
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


_RANDOM = torch.randint(0, 1 << 32, (25,), generator=torch.Generator().manual_seed(0),
                        dtype=torch.int64)
WORDS = [0, MASK, 0x89ABCDEF, 0x76543210, 0x0F0F0F0F, 0xF0F0F0F0, 0x80FF017F] + [
    int(v) & MASK for v in _RANDOM]


def _inputs(bits: int, kind: str, word: int, z: int) -> dict[int, int]:
    """The asm's operands as the kernel builds them: the word, and (magic + zero) packed."""
    outs = 32 // bits
    if bits == 8 and kind == "bf16":
        zz = _bits32(8388608.0 + z)
    else:
        magic = 128.0 if kind == "bf16" else 1024.0
        zb = _bits16(magic + z, kind)
        zz = zb | (zb << 16)
    return {outs: word, outs + 1: zz}


@pytest.mark.parametrize("bits, kind", [(4, "bf16"), (4, "f16"), (8, "bf16"), (8, "f16")])
def test_asm_gives_q_minus_zero_in_the_pair_order(bits: int, kind: str) -> None:
    asm = {(4, "bf16"): g.ASM_U4_BF16, (4, "f16"): g.ASM_U4_F16, (8, "bf16"): g.ASM_U8_BF16,
           (8, "f16"): g.ASM_U8_F16}[(bits, kind)].value
    order = g.PAIR_ORDER[bits]
    for word in WORDS:
        for z in (0, 1 << (bits - 1), (1 << bits) - 1, 3):
            out = run_ptx(asm, _inputs(bits, kind, word, z))
            got = [_half(out[i], kind) for i in range(len(order))]
            want = [float(((word >> (bits * j)) & ((1 << bits) - 1)) - z) for j in order]
            assert got == want, (hex(word), z, got, want)


@triton.jit
def _tile_kernel(w_ptr, z_ptr, out_ptr, BITS: tl.constexpr, BN: tl.constexpr,
                 W: tl.constexpr, BK: tl.constexpr):
    rows = tl.arange(0, BN)
    words = tl.load(w_ptr + rows[:, None] * W + tl.arange(0, W)[None, :])  # (BN, W)
    z = tl.load(z_ptr + rows)  # (BN,)
    tile = _dequant_tile(words, z, BITS, tl.float16, False, BN, BK)  # (BN, BK)
    tl.store(out_ptr + rows[:, None] * BK + tl.arange(0, BK)[None, :], tile)


@pytest.mark.parametrize("bits", [4, 8])
def test_plain_triton_path_gives_the_same_order(bits: int) -> None:
    bn, w = 8, 4
    pack = 32 // bits
    words = torch.tensor(WORDS[:bn * w], dtype=torch.int64).reshape(bn, w)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    z = torch.arange(bn, dtype=torch.float32) % (1 << bits)
    out = torch.empty(bn, w * pack, dtype=torch.float16)
    _tile_kernel[(1,)](words, z, out, BITS=bits, BN=bn, W=w, BK=w * pack)
    u = words.to(torch.int64) & MASK
    for i, j in enumerate(g.PAIR_ORDER[bits]):
        want = ((u >> (bits * j)) & ((1 << bits) - 1)).float() - z[:, None]  # (BN, W)
        torch.testing.assert_close(out[:, i::pack].float(), want, rtol=0, atol=0)
