"""compressed-tensors `pack-quantized` weight-only schemes (W4A16, W8A16 as llm-compressor writes
them), repacked into the shared weight-only int layout. The compressed-tensors config dispatcher
builds one `CompressedTensorsWNA16Method(scheme)` per linear layer from the scheme's "weights"
dict.

Per linear layer: `weight_packed` (out, in / p) int32, values + 2^(b-1) packed along the input
dim (p = 32 / bits, value k of a word in bits (k % p) * bits); `weight_scale` (out, in / G), or
(out, 1) for the channel strategy; for asymmetric schemes `weight_zero_point` (out / p, in / G)
int32 packed the same way along the output dim; `weight_shape` (2,) the unpacked (out, in); with
actorder "group" `weight_g_idx` (in,). w = (q - zero) * scale.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from peregrine.layers.quantization.base import linear_param, load_sharded
from peregrine.layers.quantization.wna16 import (WNA16LinearMethod, check_groups, load_g_idx,
                                                 unpack_int32)

if TYPE_CHECKING:
    from peregrine.layers.linear import LinearBase

STRATEGIES = ("group", "channel")


class CompressedTensorsWNA16Method(WNA16LinearMethod):
    """scheme: {"num_bits": 4 | 8, "group_size": int (group strategy), "strategy": "group" |
    "channel", "symmetric": bool, "actorder": None | "group" | "weight" | "static" | bool}."""

    checkpoint_params = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                         "weight_g_idx")

    def __init__(self, scheme: dict[str, Any]) -> None:
        bits, strategy = scheme.get("num_bits"), scheme.get("strategy")
        if bits not in (4, 8):
            raise ValueError(f"compressed-tensors: {bits}-bit weights are not supported by the "
                             "pack-quantized weight-only method (only 4 and 8)")
        if scheme.get("type", "int") != "int":
            raise ValueError(f"compressed-tensors: weight type {scheme.get('type')!r} is not an "
                             "integer type")
        if strategy not in STRATEGIES:
            raise ValueError(f"compressed-tensors: weight strategy {strategy!r} is not supported "
                             f"(supported: {', '.join(STRATEGIES)})")
        group = scheme.get("group_size")
        if strategy == "group" and (not isinstance(group, int) or group <= 0):
            raise ValueError(f"compressed-tensors: group strategy needs a positive group_size, "
                             f"got {group!r}")
        actorder = scheme.get("actorder")
        if actorder not in (None, False, True, "group", "weight", "static", "dynamic"):
            raise ValueError(f"compressed-tensors: actorder {actorder!r} is not supported")
        self.bits = bits
        self.pack = 32 // bits
        self.group_size = group if strategy == "group" else -1
        self.symmetric = bool(scheme.get("symmetric", True))
        # NOTE: "weight" (alias "static") ordering is baked into the weights; only "group"
        # (alias "dynamic", or True in older configs) keeps a g_idx.
        self.act_order = actorder in (True, "group", "dynamic") and strategy == "group"

    def create_weights(self, layer: LinearBase, in_features: int, out_sizes: list[int],
                       dtype: torch.dtype) -> None:
        out, p, name = sum(out_sizes), self.pack, "/".join(layer.prefixes)
        row_split = not layer.shards_output and layer.tp_size > 1
        in_total = in_features * layer.tp_size if row_split else in_features
        channel = self.group_size == -1
        group = in_total if channel else self.group_size
        shared = row_split and (channel or self.act_order)  # see gptq.py: whole scales per rank
        check_groups("compressed-tensors", layer, in_total if shared else in_features, group)
        if in_features % p or (not self.symmetric and out % p):
            raise ValueError(f"compressed-tensors: {name} has {in_features} inputs and {out} "
                             f"outputs per rank; they must be multiples of {p}")
        groups = (in_total if shared else in_features) // group
        group_in = None if shared else 1
        layer.weight_packed = linear_param((out, in_features // p), torch.int32, output_dim=0,
                                           input_dim=1, packed_dim=1, pack_factor=p)
        layer.weight_scale = linear_param((out, groups), dtype, output_dim=0, input_dim=group_in)
        if not self.symmetric:
            layer.weight_zero_point = linear_param((out // p, groups), torch.int32, output_dim=0,
                                                   input_dim=group_in, packed_dim=0,
                                                   pack_factor=p)
        layer.weight_shape = linear_param((2,), torch.int64, output_dim=None, input_dim=None)
        if self.act_order:
            layer.weight_g_idx = linear_param((in_features,), torch.int32, output_dim=None,
                                              input_dim=0)
        layer.wna16_dtype = dtype

    def load_weight(self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor,
                    shard: int | None, name: str) -> None:
        if param is getattr(layer, "weight_shape", None):
            # The unpacked (out, in) of this projection over all ranks: checked, not kept.
            in_total = layer.weight_packed.shape[1] * self.pack * (
                1 if layer.shards_output else layer.tp_size)
            want = [layer.out_sizes[shard or 0], in_total]
            if loaded.tolist() != want:
                raise ValueError(f"tensor {name!r}: weight_shape {loaded.tolist()} does not "
                                 f"match the model's {want}")
            return
        if param is getattr(layer, "weight_g_idx", None):
            load_g_idx(layer, param, loaded, shard, name)
            return
        load_sharded(layer, param, loaded, shard, name)

    def unpack(self, layer: LinearBase):
        q = unpack_int32(layer.weight_packed.data, self.bits, dim=1).t()  # (in, out)
        scales = layer.weight_scale.data.t()  # (G, out)
        zeros = None
        if not self.symmetric:
            # Stored like the weights: zero + 2^(b-1) in b bits.
            zeros = unpack_int32(layer.weight_zero_point.data, self.bits, dim=0).t().float()
        g_idx = layer.weight_g_idx.data if self.act_order else None
        if g_idx is not None and scales.shape[0] and q.shape[0] % scales.shape[0] == 0 and \
                torch.equal(g_idx.long(), torch.arange(q.shape[0], device=g_idx.device)
                            // (q.shape[0] // scales.shape[0])):
            g_idx = None
        return q, scales, zeros, g_idx
