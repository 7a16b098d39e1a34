"""Quantization methods by config.json `quant_method` name; see base.py for the interfaces.

Adding a method is adding a file with a `QuantizationConfig` (declaring its `name`) and its
`QuantMethod`, plus one line in `_BUILTIN` (or a `register_quantization_config` call for a
plug-in).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from peregrine.layers.quantization.base import (QuantizationConfig, QuantMethod, linear_param,
                                                load_sharded)
from peregrine.layers.quantization.unquantized import UnquantizedLinearMethod

__all__ = ["QuantMethod", "QuantizationConfig", "UnquantizedLinearMethod",
           "get_quantization_config", "linear_param", "load_sharded", "quantization_methods", "register_quantization_config",
           "resolve_quantization"]

_ConfigClass = type[QuantizationConfig]
# quant_method -> "module:Class", imported on first use.
_BUILTIN: dict[str, str] = {
    "awq": "peregrine.layers.quantization.awq:AWQConfig",
    "gptq": "peregrine.layers.quantization.gptq:GPTQConfig",
    "rtn": "peregrine.layers.quantization.rtn:RTNConfig",
    "rtn-int4": "peregrine.layers.quantization.rtn:RTNInt4Config",
    "rtn-int6": "peregrine.layers.quantization.rtn:RTNInt6Config",
    "rtn-int8": "peregrine.layers.quantization.rtn:RTNInt8Config",
    "fp8": "peregrine.layers.quantization.fp8:Fp8Config",
    "compressed-tensors":
        "peregrine.layers.quantization.compressed_tensors:CompressedTensorsConfig",
}
_REGISTERED: dict[str, _ConfigClass] = {}
# Names that choose another engine's kernel for a checkpoint format rather than a format
# (`--quantization awq_marlin` in a command written for vLLM): here each format has one
# method, which picks its kernels itself, so such a name asks for the format it reads.
_KERNEL_NAMES: dict[str, str] = {"awq_marlin": "awq", "gptq_marlin": "gptq"}


def register_quantization_config(name: str) -> Callable[[_ConfigClass], _ConfigClass]:
    """Class decorator: make `cls` the config of quant_method `name`."""
    def wrap(cls: _ConfigClass) -> _ConfigClass:
        if name in _BUILTIN or name in _KERNEL_NAMES or _REGISTERED.get(name, cls) is not cls:
            raise ValueError(f"quantization method {name!r} is already registered")
        cls.name = name
        _REGISTERED[name] = cls
        return cls
    return wrap


def quantization_methods() -> list[str]:
    """Every known quant_method name."""
    return sorted({*_BUILTIN, *_REGISTERED})


def get_quantization_config(name: str) -> _ConfigClass:
    """The config class registered for quant_method `name` (or the format a kernel's name asks
    for); ValueError naming the known ones."""
    name = _KERNEL_NAMES.get(name, name)
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTIN:
        module, cls_name = _BUILTIN[name].split(":")
        cls = getattr(importlib.import_module(module), cls_name)
        # NOTE: the name is the class's own attribute, so it holds in a process that only
        # unpickled a config (the engine core, a worker) and never went through this lookup.
        if cls.__dict__.get("name") != name:
            raise TypeError(f"{cls.__qualname__} must declare name = {name!r}")
        return cls
    known = ", ".join(quantization_methods()) or "none are available in this version"
    raise ValueError(f"unknown quantization method {name!r} (known: {known})")


def resolve_quantization(hf: dict[str, Any], requested: str | None) -> QuantizationConfig | None:
    """The checkpoint's quantization (config.json `quantization_config`), checked against the
    --quantization the user asked for (a kernel's name, `awq_marlin` or `gptq_marlin`, asks for
    its format); None for an unquantized model."""
    if requested is not None:
        requested = get_quantization_config(requested).name
    cfg = hf.get("quantization_config")
    if cfg is None:
        return None if requested is None else get_quantization_config(requested).from_config({})
    if not isinstance(cfg, dict) or not isinstance(cfg.get("quant_method"), str):
        raise ValueError("config.json: quantization_config has no 'quant_method'")
    method = cfg["quant_method"]
    if requested is not None and requested != method:
        raise ValueError(f"invalid quantization: {requested!r} disagrees with the checkpoint, "
                         f"which is quantized with {method!r}")
    return get_quantization_config(method).from_config(cfg)
