"""GPTQ checkpoints (AutoGPTQ / GPTQModel), repacked into the shared weight-only int layout.

Per linear layer: `qweight` (in / p, out) int32 packed along the input dim (p = 32 / bits,
value k of a word in bits (k % p) * bits), `qzeros` (in / G, out / p) int32 packed along the
output dim, `scales` (in / G, out) and `g_idx` (in,) int32, each input's group. Format v1
("checkpoint_format": "gptq") stores zero - 1, v2 ("gptq_v2") the zero itself; w = (q - zero) *
scale. With desc_act (act-order) the groups are not contiguous and g_idx says which is whose;
without it g_idx is ignored, as the inputs are in group order.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from peregrine.layers.quantization.awq import skip_list
from peregrine.layers.quantization.base import QuantizationConfig, QuantMethod, linear_param
from peregrine.layers.quantization.wna16 import (WNA16LinearMethod, check_groups, load_g_idx,
                                                 unpack_int32)

if TYPE_CHECKING:
    from peregrine.layers.linear import LinearBase

FORMATS = ("gptq", "gptq_v2")


class GPTQConfig(QuantizationConfig):
    """quantization_config {"quant_method": "gptq", "bits": 4 | 8, "group_size": 128 | -1,
    "desc_act": bool, "sym": bool, "checkpoint_format": "gptq" | "gptq_v2"}."""

    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, v2: bool,
                 skip: tuple[str, ...] = ()) -> None:
        self.bits, self.group_size, self.desc_act, self.sym, self.v2 = (
            bits, group_size, desc_act, sym, v2)
        self.skip_modules = skip

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> GPTQConfig:
        if not cfg:
            raise ValueError("gptq: the checkpoint is not GPTQ-quantized (config.json has no "
                             "quantization_config); use a model quantized with GPTQ")
        bits, group = cfg.get("bits", 4), cfg.get("group_size", 128)
        if bits not in (4, 8):
            raise ValueError(f"gptq: {bits}-bit weights are not supported (only 4 and 8)")
        if not isinstance(group, int) or not (group == -1 or group > 0):
            raise ValueError(f"gptq: group_size {group!r} must be positive or -1")
        fmt = cfg.get("checkpoint_format", cfg.get("format", "gptq"))
        if fmt not in FORMATS:
            raise ValueError(f"gptq: checkpoint_format {fmt!r} is not supported "
                             f"(supported: {', '.join(FORMATS)})")
        return cls(bits, group, bool(cfg.get("desc_act", False)), bool(cfg.get("sym", True)),
                   fmt == "gptq_v2", skip_list(cfg))

    def linear_method(self, prefixes: list[str]) -> QuantMethod:
        return GPTQLinearMethod(self)


class GPTQLinearMethod(WNA16LinearMethod):
    checkpoint_params = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, cfg: GPTQConfig) -> None:
        self.cfg = cfg
        self.bits = cfg.bits
        self.pack = 32 // cfg.bits

    def create_weights(self, layer: LinearBase, in_features: int, out_sizes: list[int],
                       dtype: torch.dtype) -> None:
        out, p, name = sum(out_sizes), self.pack, "/".join(layer.prefixes)
        row_split = not layer.shards_output and layer.tp_size > 1
        in_total = in_features * layer.tp_size if row_split else in_features
        group = in_total if self.cfg.group_size == -1 else self.cfg.group_size
        # NOTE: a row-parallel rank's inputs under act-order (or one group for all inputs) do
        # not own whole groups: every rank keeps all the scales and zeros, g_idx picks its own.
        shared = row_split and (self.cfg.desc_act or self.cfg.group_size == -1)
        check_groups("gptq", layer, in_total if shared else in_features, group)
        if in_features % p or out % p:
            raise ValueError(f"gptq: {name} has {in_features} inputs and {out} outputs per rank; "
                             f"both must be multiples of {p}")
        groups = (in_total if shared else in_features) // group
        group_in = None if shared else 0
        layer.qweight = linear_param((in_features // p, out), torch.int32, output_dim=1,
                                     input_dim=0, packed_dim=0, pack_factor=p)
        layer.qzeros = linear_param((groups, out // p), torch.int32, output_dim=1,
                                    input_dim=group_in, packed_dim=1, pack_factor=p)
        layer.scales = linear_param((groups, out), dtype, output_dim=1, input_dim=group_in)
        layer.g_idx = linear_param((in_features,), torch.int32, output_dim=None, input_dim=0)
        layer.wna16_dtype = dtype

    def load_weight(self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor,
                    shard: int | None, name: str) -> None:
        if param is layer.g_idx:
            if self.cfg.desc_act:
                load_g_idx(layer, param, loaded, shard, name)
            return  # NOTE: without act-order the inputs are in group order; g_idx is not read
        super().load_weight(layer, param, loaded, shard, name)

    def unpack(self, layer: LinearBase):
        bits = self.bits
        q = unpack_int32(layer.qweight.data, bits, dim=0)  # (in, out)
        # NOTE: v1 stores zero - 1 and readers add 1 back without wrapping (so a stored 2^b - 1,
        # a zero of 0 written by v1 quantizers, reads as 2^b), as AutoGPTQ's kernels do.
        zeros = unpack_int32(layer.qzeros.data, bits, dim=1).float()  # (G, out)
        if not self.cfg.v2:
            zeros = zeros + 1
        half = float(1 << (bits - 1))
        if self.cfg.sym and bool((zeros == half).all()):
            zeros = None  # the kernel's symmetric path: zero 2^(b-1) is built in
        g_idx = None
        if self.cfg.desc_act:
            g_idx = layer.g_idx.data
            k, groups = g_idx.shape[0], layer.scales.shape[0]
            contiguous = torch.arange(k, device=g_idx.device) // max(1, k // max(groups, 1))
            if groups and k % groups == 0 and torch.equal(g_idx.long(), contiguous):
                g_idx = None  # already in group order: contiguous groups
        return q, layer.scales.data, zeros, g_idx
