"""Architecture name (config.json `architectures`) -> model class; one file per family.

Adding an architecture is adding its file and one line here ("module:Class", imported on use).
"""
from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from peregrine.models.protocol import BuildOptions

_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "peregrine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "peregrine.models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "peregrine.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "peregrine.models.qwen3:Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(architecture: str) -> type[nn.Module]:
    """The class registered for `architecture`; ValueError naming the supported ones."""
    target = _REGISTRY.get(architecture)
    if target is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def build_model(architecture: str, hf: dict[str, Any], opts: BuildOptions) -> nn.Module:
    """Instantiate the model class registered for `architecture` (weights uninitialised)."""
    return model_class(architecture)(hf, opts)
