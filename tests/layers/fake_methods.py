"""Two fake quantization methods that plug in through the registry, and checkpoints for them.

- "fake_transposed": the checkpoint is unchanged; the method stores each weight as (in, out) with
  its own loader (transpose, then the generic sharded copy).
- "fake_int4": int4 values (per-output-channel scales) packed 8 per int32 along the output dim
  of column-parallel layers and along the input dim of row-parallel ones.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from peregrine.layers.quantization import (QuantizationConfig, QuantMethod, linear_param,
                                           load_sharded, quantization_methods,
                                           register_quantization_config)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
PACK = 8  # int4 values per int32


class TransposedMethod(QuantMethod):
    def create_weights(self, layer, in_features, out_sizes, dtype) -> None:
        layer.weight = linear_param((in_features, sum(out_sizes)), dtype, output_dim=1, input_dim=0)

    def load_weight(self, layer, param, loaded, shard, name) -> None:
        load_sharded(layer, param, loaded.t(), shard, name)  # checkpoint (out, in) -> (in, out)

    def apply(self, layer, x, bias=None):
        y = x @ layer.weight  # (T, out_per_rank)
        return y if bias is None else y + bias


class Int4Method(QuantMethod):
    def create_weights(self, layer, in_features, out_sizes, dtype) -> None:
        out = sum(out_sizes)
        if layer.shards_output:  # column-parallel: pack along the output dim
            shape, packed_dim = (out // PACK, in_features), 0
        else:  # row-parallel: pack along the input dim
            shape, packed_dim = (out, in_features // PACK), 1
        layer.qweight = linear_param(shape, torch.int32, output_dim=0, input_dim=1,
                                     packed_dim=packed_dim, pack_factor=PACK)
        layer.scales = linear_param((out,), dtype, output_dim=0, input_dim=None)
        layer.packed_dim = packed_dim

    def apply(self, layer, x, bias=None):
        q = unpack_int4(layer.qweight, layer.packed_dim)  # (out, in) in [-8, 7]
        w = q.to(layer.scales.dtype) * layer.scales[:, None]  # (out, in)
        return torch.nn.functional.linear(x, w, bias)


class _FakeConfig(QuantizationConfig):
    method: type[QuantMethod]

    def __init__(self, skip: tuple[str, ...] = ()) -> None:
        self.skip_modules = skip

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> QuantizationConfig:
        return cls(tuple(cfg.get("modules_to_not_convert", ())))

    def linear_method(self, prefixes: list[str]) -> QuantMethod:
        return self.method()


if "fake_transposed" not in quantization_methods():
    @register_quantization_config("fake_transposed")
    class TransposedConfig(_FakeConfig):
        method = TransposedMethod

    @register_quantization_config("fake_int4")
    class Int4Config(_FakeConfig):
        method = Int4Method


def pack_int4(q: torch.Tensor, dim: int) -> torch.Tensor:
    """Values in [-8, 7] packed 8 per int32 along `dim` (value k of a group in bits 4k..4k+3)."""
    u = (q.long() + 8).movedim(dim, -1)  # (..., n)
    u = u.reshape(*u.shape[:-1], -1, PACK)  # (..., n / 8, 8)
    packed = (u << (4 * torch.arange(PACK))).sum(-1)  # (..., n / 8) in [0, 2^32)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed)  # two's complement
    return packed.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    p = packed.movedim(dim, -1)  # (..., n / 8)
    shifts = 4 * torch.arange(PACK, device=p.device, dtype=torch.int32)
    u = (p.unsqueeze(-1) >> shifts) & 0xF  # (..., n / 8, 8)
    return (u.flatten(-2) - 8).movedim(-1, dim)  # (..., n)


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 of w (out, in) with one scale per output row: (q, scales)."""
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 7  # (out,)
    q = torch.round(w / scales[:, None]).clamp(-8, 7).to(torch.int8)  # (out, in)
    return q, scales


def write_quantized(src: Path, dst: Path, method: str, skip: tuple[str, ...] = ()) -> Path:
    """Copy checkpoint `src` to `dst` with `quant_method` set; fake_int4 also quantizes the
    weights and writes the dequantized twin (same values, unquantized) to dst/../reference."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "modules_to_not_convert": list(skip)}
    (dst / "config.json").write_text(json.dumps(cfg))
    if method != "fake_int4":
        return dst
    ref = dst.parent / f"{dst.name}-reference"
    shutil.copytree(src, ref)
    tensors = load_file(dst / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        module = name.rsplit(".", 2)
        if name.endswith(".weight") and module[-2] in PROJECTIONS and \
                not any(s in name for s in skip):
            q, scales = quantize_int4(t.float())
            dim = 1 if module[-2] in ROW_PARALLEL else 0
            prefix = name[:-len("weight")]
            quantized[prefix + "qweight"] = pack_int4(q, dim)
            quantized[prefix + "scales"] = scales.to(t.dtype)
            dequantized[name] = (q.to(t.dtype) * scales.to(t.dtype)[:, None]).contiguous()
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, dst / "model.safetensors")
    save_file(dequantized, ref / "model.safetensors")
    return dst
