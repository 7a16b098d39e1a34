"""AWQ checkpoints (AutoAWQ's GEMM layout), repacked into the shared weight-only int layout.

Per linear layer: `qweight` (in, out / 8) int32 and `qzeros` (in / G, out / 8) int32, both packed
along the output dim with AWQ's interleave (slot i of a word holds output column
[0, 2, 4, 6, 1, 3, 5, 7][i]), and `scales` (in / G, out) fp16; w = (q - zero) * scale.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from peregrine.layers.quantization.base import QuantizationConfig, QuantMethod, linear_param
from peregrine.layers.quantization.wna16 import WNA16LinearMethod, check_groups, unpack_int32

if TYPE_CHECKING:
    from peregrine.layers.linear import LinearBase

# Value j of a word sits in slot AWQ_ORDER[j] (the inverse of AutoAWQ's [0, 2, 4, 6, 1, 3, 5, 7]).
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
PACK = 8


def skip_list(cfg: dict[str, Any], key: str = "modules_to_not_convert") -> tuple[str, ...]:
    """A config's list of unquantized module names (None or absent: none)."""
    value = cfg.get(key) or ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"quantization_config: {key!r} must be a list of module names")
    return tuple(value)


class AWQConfig(QuantizationConfig):
    """quantization_config {"quant_method": "awq", "bits": 4, "group_size": 128,
    "zero_point": true, "version": "gemm"} (AutoAWQ's w_bit / q_group_size spellings too)."""

    name = "awq"

    def __init__(self, group_size: int, skip: tuple[str, ...] = ()) -> None:
        self.group_size = group_size
        self.skip_modules = skip

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> AWQConfig:
        if not cfg:
            raise ValueError("awq: the checkpoint is not AWQ-quantized (config.json has no "
                             "quantization_config); use a model quantized with AutoAWQ")
        bits = cfg.get("bits", cfg.get("w_bit", 4))
        group = cfg.get("group_size", cfg.get("q_group_size", 128))
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq: version {cfg.get('version')!r} is not supported (only the "
                             "'gemm' layout; re-export the checkpoint with version='gemm')")
        if bits != 4:
            raise ValueError(f"awq: {bits}-bit weights are not supported (only 4)")
        if cfg.get("zero_point", True) is not True:
            raise ValueError("awq: zero_point=false checkpoints are not supported")
        if not isinstance(group, int) or group <= 0 or group % PACK:
            raise ValueError(f"awq: group_size {group!r} must be a positive multiple of 8")
        return cls(group, skip_list(cfg))

    def linear_method(self, prefixes: list[str]) -> QuantMethod:
        return AWQLinearMethod(self.group_size)


class AWQLinearMethod(WNA16LinearMethod):
    bits = 4
    checkpoint_params = ("qweight", "qzeros", "scales")

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(self, layer: LinearBase, in_features: int, out_sizes: list[int],
                       dtype: torch.dtype) -> None:
        check_groups("awq", layer, in_features, self.group_size)
        out = sum(out_sizes)
        if out % PACK:
            raise ValueError(f"awq: {out} outputs of {'/'.join(layer.prefixes)} per rank are not "
                             f"a multiple of {PACK}")
        groups = in_features // self.group_size
        tags = dict(output_dim=1, input_dim=0)
        layer.qweight = linear_param((in_features, out // PACK), torch.int32, **tags,
                                     packed_dim=1, pack_factor=PACK)
        layer.qzeros = linear_param((groups, out // PACK), torch.int32, **tags, packed_dim=1,
                                    pack_factor=PACK)
        layer.scales = linear_param((groups, out), dtype, **tags)
        layer.wna16_dtype = dtype

    def unpack(self, layer: LinearBase):
        q = unpack_int32(layer.qweight.data, 4, dim=1, order=AWQ_ORDER)  # (in, out)
        zeros = unpack_int32(layer.qzeros.data, 4, dim=1, order=AWQ_ORDER).float()  # (G, out)
        return q, layer.scales.data, zeros, None
