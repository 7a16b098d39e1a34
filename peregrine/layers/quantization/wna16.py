"""The shared weight-only integer linear method (4, 6 or 8-bit weights, 16/32-bit activations).

AWQ, GPTQ, compressed-tensors and online RTN each load their checkpoint tensors in their own
format, then `process_weights_after_loading` hands the unpacked integers to `WNA16Layout.build`,
which repacks them into the one layout the fused Triton dequant-GEMM reads (kernels/wna16_gemm.py):

- `qweight` (K / pack, N) int32: unsigned values packed along the input dim K, value k of a word
  in bits (k % pack) * b: 8 per word for 4 bits, 4 per word for 8 bits; for 6 bits this holds the
  low 4 bits and `qweight_hi` (K / 16, N) the high 2 bits (16 per word), so 6 bits cost 6 bits.
- `scales` (K / G, N) in the activation dtype; `zeros` (K / G, N) the same dtype (integer zero
  points, exact in 16-bit floats) or None for symmetric weights (zero 2^(b-1)).
- `g_idx` (K,) int32 or None: each input's group when the groups are not contiguous (GPTQ
  act-order).

w[k, n] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]. On CUDA a batch of at most GEMV_MAX_M rows
(8 where the tensor-core GEMV serves the layout) runs a split-K GEMV (kernels/wna16_gemv.py,
compiled at load), larger ones the GEMM. Without CUDA the layer dequantizes and calls F.linear,
which is also the reference the kernels are tested against.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from peregrine.layers.quantization.base import QuantMethod, linear_param, load_sharded

if TYPE_CHECKING:
    from peregrine.layers.linear import LinearBase

SUPPORTED_BITS = (4, 6, 8)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int,
                 order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned `bits`-bit values packed 32 // bits per int32 along `dim` (value i in bits
    i*bits..), unpacked to int32; `order[j]` names the slot that holds value j (AWQ interleave)."""
    per = 32 // bits
    p = packed.to(torch.int32).movedim(dim, -1)  # (..., n / per)
    shifts = bits * torch.arange(per, device=p.device, dtype=torch.int32)
    if order is not None:
        shifts = shifts[list(order)]
    u = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (..., n / per, per)
    return u.flatten(-2).movedim(-1, dim)  # (..., n)


def pack_int32(values: torch.Tensor, bits: int, dim: int,
               order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of unpack_int32: unsigned values (< 2^bits) packed along `dim` into int32."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)  # (..., n)
    if v.shape[-1] % per:
        raise ValueError(f"{v.shape[-1]} values do not pack {per} to an int32")
    if v.numel() and (v.min() < 0 or v.max() >= 1 << bits):
        raise ValueError(f"values outside [0, {1 << bits}) cannot be packed in {bits} bits")
    v = v.reshape(*v.shape[:-1], -1, per)  # (..., n / per, per)
    shifts = bits * torch.arange(per, device=v.device, dtype=torch.int64)
    if order is not None:
        shifts = shifts[list(order)]
    word = (v << shifts).sum(-1)  # (..., n / per) in [0, 2^32)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word)  # two's complement
    return word.to(torch.int32).movedim(-1, dim).contiguous()


@dataclass
class WNA16Layout:
    """A layer's weight in the kernel's layout (see the module docstring)."""

    qweight: torch.Tensor  # (K / pack, N) int32
    qweight_hi: torch.Tensor | None  # (K / 16, N) int32, 6-bit only
    scales: torch.Tensor  # (K / G, N)
    zeros: torch.Tensor | None  # (K / G, N)
    g_idx: torch.Tensor | None  # (K,) int32
    bits: int
    group_size: int  # inputs per group (K for one group per output channel)
    in_features: int
    out_features: int

    @classmethod
    def build(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              g_idx: torch.Tensor | None, bits: int, dtype: torch.dtype) -> WNA16Layout:
        """From unsigned values q (K, N), scales and float zeros (num_groups, N) and an optional
        per-input group index (K,)."""
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"{bits}-bit weights are not supported (supported: 4, 6, 8)")
        k, n = q.shape
        groups = scales.shape[0]
        if scales.shape[1] != n or (zeros is not None and zeros.shape != scales.shape):
            raise ValueError(f"scales {tuple(scales.shape)} / zeros do not match the weight "
                             f"({k} inputs, {n} outputs)")
        if g_idx is not None:
            g_idx = g_idx.to(torch.int32).contiguous()
            if g_idx.shape != (k,):
                raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
            if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
                raise ValueError(f"g_idx holds groups outside [0, {groups})")
            group_size = k
        else:
            if groups == 0 or k % groups:
                raise ValueError(f"{k} inputs do not split into {groups} equal groups")
            group_size = k // groups
        need = 16 if bits == 6 else 32 // bits
        if k % need:
            raise ValueError(f"{bits}-bit packing needs the input size ({k}) to be a multiple "
                             f"of {need}")
        if bits == 6:
            qweight = pack_int32(q & 0xF, 4, dim=0)
            qweight_hi = pack_int32(q >> 4, 2, dim=0)
        else:
            qweight, qweight_hi = pack_int32(q, bits, dim=0), None
        return cls(qweight, qweight_hi, scales.to(dtype).contiguous(),
                   None if zeros is None else zeros.to(dtype).contiguous(), g_idx, bits,
                   group_size, k, n)

    def unpacked(self) -> torch.Tensor:
        """The unsigned integer values (K, N), int32."""
        if self.bits == 6:
            lo = unpack_int32(self.qweight, 4, dim=0)
            return lo | (unpack_int32(self.qweight_hi, 2, dim=0) << 4)
        return unpack_int32(self.qweight, self.bits, dim=0)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight (N, K) in `dtype`, computed in float32."""
        q = self.unpacked().float()  # (K, N)
        if self.g_idx is not None:
            rows = self.g_idx.long()  # (K,)
        else:
            rows = torch.arange(self.in_features, device=q.device) // self.group_size
        scales = self.scales.float()[rows]  # (K, N)
        zero = (self.zeros.float()[rows] if self.zeros is not None
                else float(1 << (self.bits - 1)))
        return ((q - zero) * scales).t().to(dtype)  # (N, K)

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"qweight": self.qweight, "qweight_hi": self.qweight_hi, "scales": self.scales,
                 "zeros": self.zeros, "g_idx": self.g_idx}
        return {k: v for k, v in named.items() if v is not None}


def _use_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda


class WNA16LinearMethod(QuantMethod):
    """Base of the weight-only integer methods: subclasses create and load their checkpoint
    parameters and say how to unpack them (`unpack`); this class repacks and applies."""

    dependent_launches = True  # the one-row and small-batch GEMVs

    bits: int

    def unpack(self, layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor,
                                                 torch.Tensor | None, torch.Tensor | None]:
        """(q (K, N) unsigned ints, scales (groups, N), float zeros (groups, N) or None for
        symmetric, g_idx (K,) or None) of this rank's loaded checkpoint tensors."""
        raise NotImplementedError

    checkpoint_params: tuple[str, ...] = ()

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        dtype = layer.wna16_dtype
        with torch.no_grad():
            q, scales, zeros, g_idx = self.unpack(layer)
            layout = WNA16Layout.build(q, scales, zeros, g_idx, self.bits, dtype)
        for name in self.checkpoint_params:  # free the checkpoint-format tensors
            if hasattr(layer, name):
                delattr(layer, name)
        for name, t in layout.tensors().items():
            layer.register_parameter(f"wna16_{name}", nn.Parameter(t, requires_grad=False))
        layer.wna16 = layout
        if _use_kernel(layout.qweight):  # no kernel compiles on the request path
            from peregrine.kernels.wna16_gemv import precompile_wna16_gemv
            precompile_wna16_gemv(layout, dtype)

    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        layout: WNA16Layout = layer.wna16
        if _use_kernel(x):
            from peregrine.kernels.gemv import use_gemv
            from peregrine.kernels.wna16_gemm import wna16_gemm
            from peregrine.kernels.wna16_gemv import gemv_supported, max_rows, wna16_gemv
            gemv = use_gemv(x, max_rows(layout, x.dtype)) and gemv_supported(layout)
            y = wna16_gemv(x, layout) if gemv else wna16_gemm(x, layout)  # (T, out_per_rank)
            return y if bias is None else y + bias
        return F.linear(x, layout.dequantize(x.dtype), bias)

    def apply_silu_and_mul(self, layer: LinearBase, h: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor | None:
        # NOTE: one decode row through the packed-half GEMV, which computes the activation as
        # it reads its inputs (one launch fewer per layer, bit for bit the unfused result).
        if not _use_kernel(h):
            return None
        from peregrine.kernels.wna16_gemv import gated_supported, wna16_gemv
        layout: WNA16Layout = layer.wna16
        if not gated_supported(layout, h):
            return None
        y = wna16_gemv(h, layout, gated=True)
        return y if bias is None else y + bias


def check_groups(method: str, layer: LinearBase, in_features: int, group_size: int) -> None:
    """A clear error when this rank's inputs do not split into whole groups."""
    if group_size != -1 and in_features % group_size:
        where = (f" per rank (tensor-parallel size {layer.tp_size})" if layer.tp_size > 1
                 and not layer.shards_output else "")
        raise ValueError(f"{method}: {in_features} inputs{where} of {'/'.join(layer.prefixes)} "
                         f"are not a multiple of group_size {group_size}")


def load_g_idx(layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard: int | None,
               name: str) -> None:
    """Load an act-order g_idx; the projections of a fused layer share their input, so their
    g_idx must agree (one per input row is all the kernel reads)."""
    if not getattr(layer, "wna16_g_idx_loaded", False):
        load_sharded(layer, param, loaded, shard, name)
        layer.wna16_g_idx_loaded = True
        return
    other = linear_param(tuple(param.shape), param.dtype, output_dim=param.output_dim,
                         input_dim=param.input_dim)
    load_sharded(layer, other, loaded, shard, name)
    if not torch.equal(other.data, param.data):
        raise ValueError(f"tensor {name!r}: the act-order g_idx differs between the fused "
                         f"projections of {'/'.join(layer.prefixes)}, which share one input")
