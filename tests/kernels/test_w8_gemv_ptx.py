"""The 8-bit GEMV's int8 conversion (kernels/gemv.py, ASM_I8_F32: inline PTX, compiled kernels
only) run on the CPU by the warp emulator of test_wna16_gemv_tc_ptx.py: every int8 value in
every byte position of the register comes out as the exact float32 value, first byte first."""
from __future__ import annotations

import torch

from peregrine.kernels.gemv import ASM_I8_F32
from test_wna16_gemv_tc_ptx import _f32, run_warp


def _convert(values: torch.Tensor) -> torch.Tensor:
    """values (32, 4) int8 through the asm, one register a lane -> (32, 4) float32."""
    words = values.contiguous().view(torch.int32).reshape(32).tolist()
    out = run_warp(ASM_I8_F32.value, [{4: w & 0xFFFFFFFF} for w in words], "f16")
    return torch.tensor([[_f32(lane[j]) for j in range(4)] for lane in out])


def test_every_int8_value_in_every_byte_position_is_exact() -> None:
    every = torch.arange(-128, 128, dtype=torch.int8)  # (256,)
    for shift in range(4):  # each value through each byte position
        values = torch.roll(every, shift * 32).reshape(2, 32, 4)
        for half in values:
            assert torch.equal(_convert(half), half.float())


def test_a_byte_order_mistake_would_be_caught() -> None:
    values = torch.arange(-64, 64, dtype=torch.int8).reshape(32, 4)
    got = _convert(values)
    assert torch.equal(got, values.float())
    assert not torch.equal(got, values.flip(1).float())  # the reverse order is not what comes out
