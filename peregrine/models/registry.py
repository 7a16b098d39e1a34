"""Architecture name (config.json `architectures`) -> model class."""
from __future__ import annotations

from typing import Any

from torch import nn

from peregrine.models import llama

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": llama.LlamaForCausalLM,
    "MistralForCausalLM": llama.MistralForCausalLM,
    "Qwen2ForCausalLM": llama.Qwen2ForCausalLM,
    "Qwen3ForCausalLM": llama.Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def build_model(architecture: str, hf: dict[str, Any], backend) -> nn.Module:
    """Instantiate the model class registered for `architecture` (weights uninitialised)."""
    cls = _REGISTRY.get(architecture)
    if cls is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    return cls(hf, backend)
