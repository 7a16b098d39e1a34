"""compressed-tensors checkpoints (as llm-compressor writes them): `config_groups` of schemes,
each with `targets` (the class "Linear", module names, or "re:" regular expressions), `weights`
and `input_activations` arguments and a `format`; `ignore` lists unquantized modules.

Supported here: W8A8 FP8 (float-quantized / naive-quantized: per-channel or per-tensor weights,
per-token dynamic or static per-tensor activations; 128x128-style block weights with dynamic
per-group activations) and W8A8 INT8 (int-quantized / naive-quantized, symmetric). Weight-only
int schemes in pack-quantized format are handed to CompressedTensorsWNA16Method
(compressed_tensors_wna16.py). `kv_cache_scheme` is read by the attention side, not here.
"""
from __future__ import annotations

import re
from typing import Any

from peregrine.layers.quantization.base import QuantizationConfig, QuantMethod
from peregrine.layers.quantization.fp8 import Fp8BlockMethod, Fp8W8A8Method
from peregrine.layers.quantization.int8 import Int8W8A8Method
from peregrine.layers.quantization.unquantized import UnquantizedLinearMethod

FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
_LINEAR_CLASSES = ("Linear", "LinearBase")


def _matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target or name.endswith("." + target)


class CompressedTensorsConfig(QuantizationConfig):
    """quant_method "compressed-tensors"."""

    name = "compressed-tensors"

    def __init__(self, groups: dict[str, dict[str, Any]], fmt: str | None,
                 ignore: tuple[str, ...], kv_cache_scheme: dict[str, Any] | None) -> None:
        self.groups = groups
        self.format = fmt
        self.skip_modules = ignore
        self.kv_cache_scheme = kv_cache_scheme
        for name, scheme in groups.items():  # refuse unsupported schemes at start-up, by name
            self._scheme_method(name, scheme)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> CompressedTensorsConfig:
        if not cfg:
            raise ValueError("compressed-tensors needs the checkpoint's quantization_config "
                             "(it cannot quantize a model at load)")
        groups = cfg.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError("compressed-tensors: quantization_config has no config_groups")
        for key in ("transform_config",):
            if cfg.get(key):
                raise ValueError(f"compressed-tensors: {key} is not supported")
        sparsity = cfg.get("sparsity_config") or {}
        if sparsity and sparsity.get("format", "dense") != "dense":
            raise ValueError(f"compressed-tensors: sparsity format {sparsity.get('format')!r} "
                             "is not supported")
        fmt = cfg.get("format")
        if fmt not in (*FORMATS, "mixed-precision", None):
            raise ValueError(f"compressed-tensors: format {fmt!r} is not supported "
                             f"({', '.join(FORMATS)})")
        for name, scheme in groups.items():
            if not isinstance(scheme, dict) or not isinstance(scheme.get("targets"), list):
                raise ValueError(f"compressed-tensors: config group {name!r} has no targets list")
        kv = cfg.get("kv_cache_scheme")
        kv = kv if isinstance(kv, dict) else None
        return cls(groups, fmt, tuple(cfg.get("ignore") or ()), kv)

    def is_skipped(self, prefix: str) -> bool:
        return any(_matches(s, prefix) for s in self.skip_modules)

    def _group_of(self, prefix: str) -> str | None:
        """The config group whose targets name this module; a name or regex beats a class."""
        by_class = None
        for name, scheme in self.groups.items():
            for target in scheme["targets"]:
                if target in _LINEAR_CLASSES:
                    by_class = by_class or name
                elif _matches(target, prefix):
                    return name
        return by_class

    def linear_method(self, prefixes: list[str]) -> QuantMethod:
        groups = {self._group_of(p) for p in prefixes}
        if len(groups) > 1:
            raise ValueError(f"compressed-tensors: the fused modules {prefixes} fall in different "
                             f"config groups {sorted(map(str, groups))}")
        group = groups.pop()
        if group is None:
            return UnquantizedLinearMethod()
        return self._scheme_method(group, self.groups[group])

    def _scheme_method(self, group: str, scheme: dict[str, Any]) -> QuantMethod:
        fmt = scheme.get("format") or self.format
        where = f"compressed-tensors group {group!r}"
        if fmt not in FORMATS:
            raise ValueError(f"{where}: format {fmt!r} is not supported ({', '.join(FORMATS)})")
        w, a = scheme.get("weights"), scheme.get("input_activations")
        if scheme.get("output_activations"):
            raise ValueError(f"{where}: output activation quantization is not supported")
        if not w:
            raise ValueError(f"{where}: schemes without weight quantization are not supported")
        wtype, bits = w.get("type", "int"), w.get("num_bits", 8)
        strategy = w.get("strategy")
        if fmt == "pack-quantized":
            if a or wtype != "int":
                raise ValueError(f"{where}: pack-quantized is only read for weight-only int "
                                 f"schemes (got {wtype}{bits} weights, activations {a})")
            return _wna16_method(w)
        if not a:
            raise ValueError(f"{where}: weight-only {wtype}{bits} in format {fmt!r} is not "
                             "supported (W8A8 needs input_activations; weight-only int uses "
                             "pack-quantized)")
        if bits != 8 or a.get("num_bits", 8) != 8 or a.get("type", "int") != wtype:
            raise ValueError(f"{where}: only W8A8 is supported with activations (got "
                             f"{wtype}{bits} weights, {a.get('type', 'int')}{a.get('num_bits', 8)} "
                             "activations)")
        if w.get("dynamic", False) is not False:
            raise ValueError(f"{where}: dynamic weight scales are not supported")
        if not w.get("symmetric", True):
            raise ValueError(f"{where}: asymmetric weights (weight zero points) are not supported")
        if not a.get("symmetric", True):
            raise ValueError(f"{where}: asymmetric activations (input zero points) are not "
                             "supported")
        allowed = ("float-quantized", "naive-quantized") if wtype == "float" else \
            ("int-quantized", "naive-quantized")
        if wtype not in ("float", "int") or fmt not in allowed:
            raise ValueError(f"{where}: {wtype} weights cannot be read in format {fmt!r}")
        a_strategy, a_dynamic = a.get("strategy"), a.get("dynamic", False)
        if strategy == "block":
            block = w.get("block_structure")
            if wtype != "float" or not (isinstance(block, list) and len(block) == 2):
                raise ValueError(f"{where}: block weights need float type and a two-entry "
                                 f"block_structure (got {wtype}, {block!r})")
            if a_strategy != "group" or a_dynamic is not True or a.get("group_size") != block[1]:
                raise ValueError(f"{where}: block weights need dynamic group activations with "
                                 f"group_size {block[1]} (got {a_strategy}, dynamic={a_dynamic}, "
                                 f"group_size={a.get('group_size')})")
            return Fp8BlockMethod((int(block[0]), int(block[1])), scale_name="weight_scale")
        if strategy not in ("channel", "tensor"):
            raise ValueError(f"{where}: weight strategy {strategy!r} is not supported with "
                             "activations (channel, tensor, block)")
        if a_strategy == "token" and a_dynamic is True:
            static = False
        elif a_strategy == "tensor" and a_dynamic is False:
            static = True
        else:
            raise ValueError(f"{where}: activation strategy {a_strategy!r} with dynamic="
                             f"{a_dynamic!r} is not supported (token dynamic, tensor static)")
        cls = Fp8W8A8Method if wtype == "float" else Int8W8A8Method
        return cls(strategy, static_input=static)


def _wna16_method(weights: dict[str, Any]) -> QuantMethod:
    """The weight-only int method (compressed_tensors_wna16.py), imported on first use."""
    try:
        from peregrine.layers.quantization.compressed_tensors_wna16 import \
            CompressedTensorsWNA16Method
    except ImportError as e:
        raise ValueError("compressed-tensors: weight-only pack-quantized schemes need "
                         "compressed_tensors_wna16.py, which this version lacks") from e
    return CompressedTensorsWNA16Method(weights)
