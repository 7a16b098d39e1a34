"""FP8 (e4m3) W8A8: Hugging Face `fp8` checkpoints (128x128 block scales or per-tensor scales)
and online FP8 (`--quantization fp8` on a 16-bit checkpoint: per-channel scales computed at load).

Activations are quantized per token at run time (or with a static per-tensor `input_scale`).
On GPUs with FP8 tensor cores (compute capability 8.9+) the matmul is `torch._scaled_mm` with
row-wise scales (per-channel weights) or the block-scaled Triton GEMM (kernels/fp8_quant.py);
elsewhere, the CPU included, the same quantized values are dequantized and multiplied in float32.
Small batches on those GPUs (decode) instead compute x @ dequant(W) with x as it is: up to
TC_GEMV_MAX_M rows of FP8 weights with per-channel or block scales by the tensor-core GEMV
(kernels/w8_gemv_tc.py; per-channel scales, FP8 or int8 (int8.py), from TC_GEMV_MIN_M rows,
block scales from TC_GEMV_BLOCK_MIN_M), the rows below (at most W8_GEMV_MAX_M) and other
weights by the 8-bit GEMV (kernels/gemv.py). Weight-only math reads the same 8-bit weight bytes,
is more accurate than rounding x to 8 bits, and ignores a static input_scale. A down
projection's rows that the 8-bit GEMV serves take the gate-and-up rows instead, SiLU-and-mul
computed as the GEMV reads them (apply_silu_and_mul).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from peregrine.kernels.gemv import (W8_GEMV_MAX_M, precompile_w8_gemv, use_gemv, w8_gemv,
                                     w8_gemv_ready, w8_gemv_takes_norm, w8_gemv_takes_silu_out)
from peregrine.kernels.fp8_quant import (FP8_DTYPE, FP8_MAX, per_token_group_quant,
                                         quantize_with_scale, w8a8_block_fp8_matmul,
                                         w8a8_block_matmul_ref)
from peregrine.layers.quantization.base import (QuantizationConfig, QuantMethod, linear_param,
                                                load_sharded)

if TYPE_CHECKING:
    from peregrine.layers.linear import LinearBase


@functools.lru_cache(maxsize=None)
def _fp8_tensor_cores(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def fp8_gemm_supported(x: torch.Tensor) -> bool:
    """Whether x's device has FP8 tensor cores (Ada / Hopper and later) and x is 16-bit."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and _fp8_tensor_cores(x.device.index if x.device.index is not None
                                  else torch.cuda.current_device()))


def quantize_input(x: torch.Tensor, dtype: torch.dtype,
                   input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> q (M, K) in dtype and its (M, 1) fp32 scales: per token, or the static
    per-tensor input_scale (shape (1, 1)) when given."""
    if input_scale is None:
        return per_token_group_quant(x, dtype)
    return quantize_with_scale(x, input_scale, dtype), input_scale.expand(x.shape[0], 1)


# Rows of 16-bit x (TC_GEMV_MIN_M..TC_GEMV_MAX_M, or from TC_GEMV_BLOCK_MIN_M with block
# scales) that the FP8 tensor-core GEMV (kernels/w8_gemv_tc.py) takes where it reads the weight
# and its scales, x as it is; other rows take the 8-bit GEMV up to W8_GEMV_MAX_M, above it FP8
# activations and torch._scaled_mm or the block-scaled GEMM. TC_GEMV_MAX_M = 0: off. Measured
# per Llama-3-8B layer (H200, bf16 x), per-channel scales: 1 row, 70 us against 63-65 for the
# 8-bit GEMV; 2 rows, 72 against 79; 8 rows, 80 against 135 for torch._scaled_mm. 128 x 128
# blocks: 1 row, 71 against 77-82. int8 per channel: 1 row, 73 against 67; 2 rows, 75 against
# 85 (see the benchmarks).
TC_GEMV_MIN_M = 2
TC_GEMV_BLOCK_MIN_M = 1
TC_GEMV_MAX_M = 8


def _tc_rows(rows: int, weight: torch.Tensor, weight_scale: torch.Tensor,
             block: tuple[int, int] | None = None) -> bool:
    if not (TC_GEMV_MIN_M if block is None else TC_GEMV_BLOCK_MIN_M) <= rows <= TC_GEMV_MAX_M:
        return False  # prefill chunks: nothing more to look at
    from peregrine.kernels.w8_gemv_tc import fp8_tc_weight_ok
    return fp8_tc_weight_ok(weight, weight_scale, block)


def unrounded_rows(rows: int, weight: torch.Tensor, weight_scale: torch.Tensor,
                   block: tuple[int, int] | None = None) -> bool:
    """Whether the FP8 layers multiply `rows` rows of 16-bit x on the GPU as they are (the
    8-bit GEMV or the tensor-core GEMV) rather than rounding them to FP8."""
    return 0 < rows <= W8_GEMV_MAX_M or _tc_rows(rows, weight, weight_scale, block)


def _precompile_tc(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   block: tuple[int, int] | None = None) -> None:
    if TC_GEMV_MAX_M > 0 and weight.is_cuda:
        from peregrine.kernels.w8_gemv_tc import precompile_w8_gemv_tc
        precompile_w8_gemv_tc(weight, scale, dtype, block)


def tc_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              block: tuple[int, int] | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x @ dequant(weight)^T (+ bias) by the tensor-core GEMV where it serves x's rows, else
    None."""
    if not (x.dim() == 2 and x.is_cuda and _tc_rows(x.shape[0], weight, scale, block)):
        return None
    from peregrine.kernels.w8_gemv_tc import fp8_tc_supported, w8_gemv_tc
    if not fp8_tc_supported(x, weight, scale, block):
        return None
    y = w8_gemv_tc(x, weight, scale, block=block)  # (M, N)
    return y if bias is None else y + bias


def apply_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """y (M, N) = quant(x) @ weight^T with weight (N, K) fp8 and weight_scale (1, N) fp32."""
    # decode: x @ dequant(W), x not rounded
    y = tc_linear(x, weight, weight_scale, None, bias)
    if y is not None:
        return y
    if use_gemv(x, W8_GEMV_MAX_M) and w8_gemv_ready(weight):
        y = w8_gemv(x, weight, weight_scale)  # (M, N)
        return y if bias is None else y + bias
    x = x.contiguous()  # (M, K)
    xq, xs = quantize_input(x, FP8_DTYPE, input_scale)  # (M, K) fp8, (M, 1) fp32
    n, k = weight.shape
    if fp8_gemm_supported(x) and k % 16 == 0 and n % 16 == 0 and x.shape[0] > 0:
        # NOTE: row-wise scaling wants fp32 scales (M, 1) and (1, N) and a bf16 output.
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs.contiguous(), scale_b=weight_scale,
                             out_dtype=torch.bfloat16)  # (M, N)
        y = y.to(x.dtype)
    else:
        y = ((xq.float() * xs) @ (weight.float() * weight_scale.t()).t()).to(x.dtype)  # (M, N)
    return y if bias is None else y + bias


def apply_w8_silu_and_mul(h: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                          block: tuple[int, int] | None, bias: torch.Tensor | None,
                          residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """y (M, N) of x = silu(h[:, :K]) * h[:, K:] for decode rows h (M, 2K) through the 8-bit
    GEMV, which computes the activation as it reads its inputs (one launch fewer per layer, bit
    for bit the unfused result), plus `residual` (M, N) in its epilogue when given; None where
    the GEMV does not serve h."""
    if not _w8_gemv_rows(h, weight, scale, block):
        return None
    y = w8_gemv(h.reshape(-1, h.shape[-1]), weight, scale, block, gated=True,
                residual=residual)  # (M, N)
    return y if bias is None else y + bias


def _w8_gemv_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  block: tuple[int, int] | None) -> bool:
    """Whether the 8-bit GEMV (not its tensor-core form, nor the GEMMs) takes x's rows."""
    if not (use_gemv(x, W8_GEMV_MAX_M) and w8_gemv_ready(weight, block)):
        return False
    return not (x.is_cuda and _tc_rows(x.numel() // x.shape[-1], weight, scale, block))


def apply_w8_add(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 block: tuple[int, int] | None, residual: torch.Tensor) -> torch.Tensor | None:
    """residual + x @ dequant(weight)^T through the 8-bit GEMV, the add in its epilogue; None
    where the GEMV does not serve x."""
    if not _w8_gemv_rows(x, weight, scale, block):
        return None
    return w8_gemv(x.reshape(-1, x.shape[-1]), weight, scale, block, residual=residual)


def apply_w8_rms_normed(h: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        block: tuple[int, int] | None, norm_weight: torch.Tensor, eps: float,
                        bias: torch.Tensor | None) -> torch.Tensor | None:
    """RMSNorm(h) * norm_weight @ dequant(weight)^T through the 8-bit GEMV, which normalises
    the row as it reads it: one decode row (w8_gemv_takes_norm); None elsewhere."""
    if not (_w8_gemv_rows(h, weight, scale, block)
            and w8_gemv_takes_norm(h.numel() // h.shape[-1])):
        return None
    y = w8_gemv(h.reshape(-1, h.shape[-1]), weight, scale, block, norm=(norm_weight, eps))
    return y if bias is None else y + bias


def apply_w8_rms_normed_silu_and_mul(h: torch.Tensor, weight: torch.Tensor,
                                     scale: torch.Tensor, block: tuple[int, int] | None,
                                     norm_weight: torch.Tensor, eps: float
                                     ) -> torch.Tensor | None:
    """silu(y[:, :I]) * y[:, I:] of y = apply_w8_rms_normed(h) for a gate-and-up weight (2I, K),
    the activation in the GEMV's epilogue (the next GEMV then reads I inputs, not 2I): one
    decode row on an unsplit launch (w8_gemv_takes_silu_out); None elsewhere."""
    rows = h.numel() // h.shape[-1]
    if not (_w8_gemv_rows(h, weight, scale, block) and w8_gemv_takes_norm(rows)
            and w8_gemv_takes_silu_out(rows, weight.shape[0], weight.shape[1], block, h.device)):
        return None
    return w8_gemv(h.reshape(-1, h.shape[-1]), weight, scale, block, norm=(norm_weight, eps),
                   silu_out=True)


class W8A8Method(QuantMethod):
    """8-bit weights with per-channel or per-tensor scales, 8-bit activations (per token, or a
    static per-tensor input_scale). After loading: layer.weight (N, K), layer.weight_scale (1, N)
    fp32 and layer.input_scale (1, 1) fp32 or None. Subclasses pick the 8-bit type and matmul."""

    weight_dtype: torch.dtype
    dependent_launches = True  # the 8-bit GEMVs at small batches

    def __init__(self, weight_strategy: str = "channel", static_input: bool = False) -> None:
        if weight_strategy not in ("channel", "tensor"):
            raise ValueError(f"W8A8 weight scales per {weight_strategy!r} are not supported "
                             "(channel, tensor)")
        self.weight_strategy = weight_strategy
        self.static_input = static_input

    def create_weights(self, layer: LinearBase, in_features: int, out_sizes: list[int],
                       dtype: torch.dtype) -> None:
        self.act_dtype = dtype
        layer.weight = linear_param((sum(out_sizes), in_features), self.weight_dtype,
                                    output_dim=0, input_dim=1)
        if self.weight_strategy == "channel":
            layer.weight_scale = linear_param((sum(out_sizes), 1), torch.float32, output_dim=0,
                                              input_dim=None)
        else:
            layer.weight_scale = _per_shard_scalar(len(out_sizes))
        layer.input_scale = _per_shard_scalar(len(out_sizes)) if self.static_input else None

    def load_weight(self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor,
                    shard: int | None, name: str) -> None:
        if getattr(param, "per_shard_scalar", False):
            if loaded.numel() != 1:
                raise ValueError(f"tensor {name!r}: a per-tensor scale must hold one value, got "
                                 f"shape {tuple(loaded.shape)}")
            param.data[shard or 0] = loaded.reshape(()).float()
            return
        load_sharded(layer, param, loaded, shard, name)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        scale = layer.weight_scale.data
        if self.weight_strategy == "tensor":  # one scale per merged projection -> per channel
            sizes = torch.tensor([s // (1 if not layer.shards_output else layer.tp_size)
                                  for s in layer.out_sizes], device=scale.device)
            scale = scale.repeat_interleave(sizes)
        layer.weight_scale = nn.Parameter(scale.reshape(1, -1).float().contiguous(),
                                          requires_grad=False)  # (1, N)
        if layer.input_scale is not None:
            # NOTE: fused projections share one input; the largest scale covers all of them.
            layer.input_scale = nn.Parameter(layer.input_scale.data.max().reshape(1, 1),
                                             requires_grad=False)
        precompile_w8_gemv(layer.weight, layer.weight_scale, self.act_dtype,
                           gate_up=layer.is_equal_pair)
        _precompile_tc(layer.weight, layer.weight_scale, self.act_dtype)

    def apply_silu_and_mul(self, layer: LinearBase, h: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor | None:
        return apply_w8_silu_and_mul(h, layer.weight, layer.weight_scale, None, bias)

    def apply_add(self, layer: LinearBase, x: torch.Tensor,
                  residual: torch.Tensor) -> torch.Tensor | None:
        return apply_w8_add(x, layer.weight, layer.weight_scale, None, residual)

    def apply_silu_and_mul_add(self, layer: LinearBase, h: torch.Tensor,
                               residual: torch.Tensor) -> torch.Tensor | None:
        return apply_w8_silu_and_mul(h, layer.weight, layer.weight_scale, None, None, residual)

    def apply_rms_normed(self, layer: LinearBase, h: torch.Tensor, norm_weight: torch.Tensor,
                         eps: float, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        return apply_w8_rms_normed(h, layer.weight, layer.weight_scale, None, norm_weight, eps,
                                   bias)

    def apply_rms_normed_silu_and_mul(self, layer: LinearBase, h: torch.Tensor,
                                      norm_weight: torch.Tensor,
                                      eps: float) -> torch.Tensor | None:
        return apply_w8_rms_normed_silu_and_mul(h, layer.weight, layer.weight_scale, None,
                                                norm_weight, eps)


def _per_shard_scalar(num_shards: int) -> nn.Parameter:
    """One fp32 scale per merged projection, the same on every rank."""
    param = linear_param((num_shards,), torch.float32, output_dim=None, input_dim=None)
    param.data.fill_(1.0)
    param.per_shard_scalar = True
    return param


class Fp8W8A8Method(W8A8Method):
    """FP8 weights with per-channel or per-tensor scales, FP8 activations."""

    weight_dtype = FP8_DTYPE

    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply_fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, bias)


class Fp8OnlineMethod(Fp8W8A8Method):
    """A 16-bit checkpoint quantized at load: per-channel FP8 weights, per-token activations."""

    def create_weights(self, layer: LinearBase, in_features: int, out_sizes: list[int],
                       dtype: torch.dtype) -> None:
        self.act_dtype = dtype
        layer.weight = linear_param((sum(out_sizes), in_features), dtype, output_dim=0,
                                    input_dim=1)
        layer.input_scale = None

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        w = layer.weight.data  # (N, K) in the model dtype
        scale = (w.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # (N, 1)
        layer.weight = nn.Parameter(quantize_with_scale(w, scale, FP8_DTYPE), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.reshape(1, -1).contiguous(), requires_grad=False)
        precompile_w8_gemv(layer.weight, layer.weight_scale, self.act_dtype,
                           gate_up=layer.is_equal_pair)
        _precompile_tc(layer.weight, layer.weight_scale, self.act_dtype)


class Fp8BlockMethod(QuantMethod):
    """FP8 weights with one scale per (bn x bk) block, activations quantized per token and group
    of bk inputs (DeepSeek-V3 / Qwen FP8 checkpoints). scale_name: the checkpoint's tensor name
    for the block scales (`weight_scale_inv` in Hugging Face fp8, `weight_scale` elsewhere)."""

    dependent_launches = True  # the 8-bit GEMVs at small batches

    def __init__(self, block: tuple[int, int], scale_name: str = "weight_scale_inv") -> None:
        self.block = block
        self.scale_name = scale_name

    def create_weights(self, layer: LinearBase, in_features: int, out_sizes: list[int],
                       dtype: torch.dtype) -> None:
        bn, bk = self.block
        self.act_dtype = dtype
        out = sum(out_sizes)
        if layer.shards_output and (len(out_sizes) > 1 or layer.tp_size > 1) and \
                any(s % bn for s in out_sizes):
            raise ValueError(f"fp8 weight_block_size {list(self.block)}: output sizes "
                             f"{out_sizes} per rank are not multiples of {bn}")
        if not layer.shards_output and layer.tp_size > 1 and in_features % bk:
            raise ValueError(f"fp8 weight_block_size {list(self.block)}: {in_features} inputs "
                             f"per rank are not a multiple of {bk}")
        layer.weight = linear_param((out, in_features), FP8_DTYPE, output_dim=0, input_dim=1)
        packed_dim, factor = (0, bn) if layer.shards_output else (1, bk)
        shape = (-(-out // bn), -(-in_features // bk))
        scale = linear_param(shape, torch.float32, output_dim=0, input_dim=1,
                             packed_dim=packed_dim if factor > 1 else None, pack_factor=factor)
        setattr(layer, self.scale_name, scale)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        precompile_w8_gemv(layer.weight, getattr(layer, self.scale_name), self.act_dtype,
                           self.block, gate_up=layer.is_equal_pair)
        _precompile_tc(layer.weight, getattr(layer, self.scale_name), self.act_dtype, self.block)

    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        scale = getattr(layer, self.scale_name)  # (N / bn, K / bk)
        # decode: x not rounded
        y = tc_linear(x, layer.weight, scale, self.block, bias)
        if y is not None:
            return y
        if use_gemv(x, W8_GEMV_MAX_M) and w8_gemv_ready(layer.weight, self.block):
            y = w8_gemv(x, layer.weight, scale, self.block)  # (M, N)
            return y if bias is None else y + bias
        x = x.contiguous()  # (M, K)
        xq, xs = per_token_group_quant(x, FP8_DTYPE, self.block[1])  # (M, K), (M, K / bk)
        if fp8_gemm_supported(x):
            y = w8a8_block_fp8_matmul(xq, xs, layer.weight, scale, self.block, x.dtype)
        else:
            y = w8a8_block_matmul_ref(xq, xs, layer.weight, scale, self.block, x.dtype)
        return y if bias is None else y + bias  # (M, N)

    def apply_silu_and_mul(self, layer: LinearBase, h: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor | None:
        return apply_w8_silu_and_mul(h, layer.weight, getattr(layer, self.scale_name),
                                     self.block, bias)

    def apply_add(self, layer: LinearBase, x: torch.Tensor,
                  residual: torch.Tensor) -> torch.Tensor | None:
        return apply_w8_add(x, layer.weight, getattr(layer, self.scale_name), self.block,
                            residual)

    def apply_silu_and_mul_add(self, layer: LinearBase, h: torch.Tensor,
                               residual: torch.Tensor) -> torch.Tensor | None:
        return apply_w8_silu_and_mul(h, layer.weight, getattr(layer, self.scale_name),
                                     self.block, None, residual)

    def apply_rms_normed(self, layer: LinearBase, h: torch.Tensor, norm_weight: torch.Tensor,
                         eps: float, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        return apply_w8_rms_normed(h, layer.weight, getattr(layer, self.scale_name), self.block,
                                   norm_weight, eps, bias)

    def apply_rms_normed_silu_and_mul(self, layer: LinearBase, h: torch.Tensor,
                                      norm_weight: torch.Tensor,
                                      eps: float) -> torch.Tensor | None:
        return apply_w8_rms_normed_silu_and_mul(h, layer.weight, getattr(layer, self.scale_name),
                                                self.block, norm_weight, eps)


class Fp8Config(QuantizationConfig):
    """quant_method "fp8": a checkpoint's `quantization_config`, or {} for online FP8."""

    name = "fp8"

    def __init__(self, *, online: bool, static_input: bool = False,
                 block: tuple[int, int] | None = None, skip: tuple[str, ...] = ()) -> None:
        self.online = online
        self.static_input = static_input
        self.block = block
        self.skip_modules = skip

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Fp8Config:
        if not cfg:  # --quantization fp8 on a 16-bit checkpoint
            return cls(online=True)
        fmt = cfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8: fmt {fmt!r} is not supported (e4m3)")
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8: activation_scheme {scheme!r} is not supported "
                             "(dynamic, static)")
        block = cfg.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, list) and len(block) == 2
                    and all(isinstance(b, int) and b > 0 for b in block)):
                raise ValueError(f"fp8: weight_block_size must be two positive integers, got "
                                 f"{block!r}")
            if scheme == "static":
                raise ValueError("fp8: block-wise weights (weight_block_size) with static "
                                 "activation scales are not supported")
            block = (block[0], block[1])
        skip = [*(cfg.get("modules_to_not_convert") or ()), *(cfg.get("ignored_layers") or ())]
        return cls(online=False, static_input=scheme == "static", block=block, skip=tuple(skip))

    def linear_method(self, prefixes: list[str]) -> QuantMethod:
        if self.online:
            return Fp8OnlineMethod()
        if self.block is not None:
            return Fp8BlockMethod(self.block)
        return Fp8W8A8Method("tensor", static_input=self.static_input)
