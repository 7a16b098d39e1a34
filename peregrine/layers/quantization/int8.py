"""INT8 W8A8 (SmoothQuant-style, as llm-compressor writes it): symmetric int8 weights with
per-channel (or per-tensor) scales, symmetric int8 activations quantized per token at run time
(or with a static per-tensor input_scale).

On CUDA the matmul is `torch._int_mm` (int32 accumulation; it needs more than 16 rows, so small
batches are padded) followed by the two scales; elsewhere the same int8 values are multiplied in
float32, which is exact for the integer products at the sizes the tests use. Small batches on
CUDA compute x @ (weight * scale)^T with x as it is, as FP8 weights do (fp8.py): the tensor-core
GEMV (kernels/w8_gemv_tc.py) at fp8.TC_GEMV_MIN_M..TC_GEMV_MAX_M rows, the 8-bit GEMV
(kernels/gemv.py, int8 bytes converted to float32 by inline PTX) at fewer (at most
W8_GEMV_MAX_M): the weight is read once, and x is not rounded to int8; a down projection's rows
that the 8-bit GEMV serves take the gate-and-up rows instead, SiLU-and-mul computed inside the
GEMV (W8A8Method, fp8.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from peregrine.kernels.gemv import W8_GEMV_MAX_M, use_gemv, w8_gemv, w8_gemv_ready
from peregrine.layers.quantization.fp8 import W8A8Method, quantize_input, tc_linear

if TYPE_CHECKING:
    from peregrine.layers.linear import LinearBase

# torch._int_mm on CUDA: more than 16 rows, and rows, K and N multiples of 8.
_INT_MM_MIN_ROWS = 24


def int_mm_supported(x: torch.Tensor, n: int, k: int) -> bool:
    return x.is_cuda and n % 8 == 0 and k % 8 == 0


def apply_int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      input_scale: torch.Tensor | None,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """y (M, N) = quant(x) @ weight^T with weight (N, K) int8 and weight_scale (1, N) fp32."""
    # decode: x @ dequant(W), x not rounded
    y = tc_linear(x, weight, weight_scale, None, bias)
    if y is not None:
        return y
    if use_gemv(x, W8_GEMV_MAX_M) and w8_gemv_ready(weight):
        y = w8_gemv(x, weight, weight_scale)  # (M, N)
        return y if bias is None else y + bias
    x = x.contiguous()  # (M, K)
    xq, xs = quantize_input(x, torch.int8, input_scale)  # (M, K) int8, (M, 1) fp32
    m = xq.shape[0]
    n, k = weight.shape
    if int_mm_supported(x, n, k) and m > 0:
        rows = max(_INT_MM_MIN_ROWS, -(-m // 8) * 8)
        xp = F.pad(xq, (0, 0, 0, rows - m)) if rows != m else xq  # (rows, K)
        acc = torch._int_mm(xp, weight.t())[:m]  # (M, N) int32
    else:
        acc = xq.float() @ weight.float().t()  # (M, N): exact integer sums in float32
    y = (acc.float() * xs * weight_scale).to(x.dtype)
    return y if bias is None else y + bias


class Int8W8A8Method(W8A8Method):
    """int8 weights (per-channel or per-tensor scales), int8 activations."""

    weight_dtype = torch.int8

    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply_int8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, bias)
