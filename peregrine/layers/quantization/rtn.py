"""Online round-to-nearest weight-only quantization of an unquantized checkpoint: `rtn` (4-bit),
`rtn-int4`, `rtn-int6`, `rtn-int8` (--quantization NAME), symmetric, one scale per 128 inputs
of each output (per output channel when the input size is not a multiple of 128).

The checkpoint's weight loads as usual; `process_weights_after_loading` quantizes it into the
shared weight-only int layout and frees it, layer by layer, so the peak is the 16-bit model plus
one layer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from peregrine.layers.quantization.awq import skip_list
from peregrine.layers.quantization.base import QuantizationConfig, QuantMethod, linear_param
from peregrine.layers.quantization.wna16 import WNA16LinearMethod

if TYPE_CHECKING:
    from peregrine.layers.linear import LinearBase

GROUP_SIZE = 128


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest of w (N, K) with one scale per group of inputs: unsigned values
    q (K, N) (zero 2^(b-1)) and scales (K / G, N) in scale_dtype."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"rtn: {k} inputs are not a multiple of group_size {group_size}")
    qmax = (1 << (bits - 1)) - 1
    wt = w.t().float().reshape(k // group_size, group_size, n)  # (K / G, G, N)
    # NOTE: scales are rounded to their storage dtype before dividing, so every weight is within
    # half a stored step of its value (|w| / s stays below qmax + 1/2 for bf16 scales, b <= 8).
    scales = (wt.abs().amax(dim=1) / qmax).clamp(min=1e-10).to(scale_dtype)  # (K / G, N)
    q = torch.round(wt / scales.float()[:, None, :]).clamp(-qmax - 1, qmax)  # (K / G, G, N)
    return (q + qmax + 1).to(torch.int32).reshape(k, n), scales


class RTNConfig(QuantizationConfig):
    """No checkpoint format: the method name picks the bit width."""

    name = "rtn"
    bits = 4

    def __init__(self, skip: tuple[str, ...] = ()) -> None:
        self.skip_modules = skip

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> RTNConfig:
        bits = cfg.get("bits", cls.bits)
        if bits != cls.bits:
            raise ValueError(f"{cls.name}: quantization_config bits {bits!r} disagree with the "
                             f"method's {cls.bits}")
        return cls(skip_list(cfg))

    def linear_method(self, prefixes: list[str]) -> QuantMethod:
        return RTNLinearMethod(self.bits)


class RTNInt4Config(RTNConfig):
    name = "rtn-int4"
    bits = 4


class RTNInt6Config(RTNConfig):
    name = "rtn-int6"
    bits = 6


class RTNInt8Config(RTNConfig):
    name = "rtn-int8"
    bits = 8


class RTNLinearMethod(WNA16LinearMethod):
    checkpoint_params = ("weight",)

    def __init__(self, bits: int) -> None:
        self.bits = bits

    def create_weights(self, layer: LinearBase, in_features: int, out_sizes: list[int],
                       dtype: torch.dtype) -> None:
        layer.weight = linear_param((sum(out_sizes), in_features), dtype, output_dim=0,
                                    input_dim=1)
        layer.wna16_dtype = dtype

    def unpack(self, layer: LinearBase):
        w = layer.weight.data  # (N, K)
        k = w.shape[1]
        group = GROUP_SIZE if k % GROUP_SIZE == 0 else k
        q, scales = rtn_quantize(w, self.bits, group, layer.wna16_dtype)
        return q, scales, None, None
