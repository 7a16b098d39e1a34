"""Per-layer K/V cache scales from a checkpoint, in the spellings quantization tools write."""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Suffix after the attention module's path (e.g. "layers.0.self_attn") -> which cache scale.
KV_SCALE_SUFFIXES: dict[str, str] = {
    "k_scale": "k", "v_scale": "v", "kv_scale": "kv",  # compressed-tensors / llm-compressor
    "attn.k_scale": "k", "attn.v_scale": "v", "attn.kv_scale": "kv",  # saved from vLLM's layout
    "k_proj.output_scale": "k", "v_proj.output_scale": "v",  # Quark, older compressed-tensors
    "k_proj.k_scale": "k", "v_proj.v_scale": "v",  # ModelOpt
}
# NOTE: these describe FP8 attention arithmetic (query and softmax quantized), which this engine
# does not do: the query stays in the model's dtype, so they have nothing to scale.
IGNORED_SUFFIXES = ("q_scale", "attn.q_scale", "prob_scale", "attn.prob_scale",
                    "q_proj.output_scale")


def take_kv_scales(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the checkpoint tensors except the K/V cache scales, which are set on the model's
    Attention layers as they pass (a scale for a module that has no Attention is an error)."""
    from peregrine.layers.attention import Attention
    # parent path ("layers.0.self_attn") -> its Attention layer
    owners = {path.rpartition(".")[0]: m for path, m in model.named_modules()
              if isinstance(m, Attention)}
    seen = 0
    for name, tensor in weights:
        hit = _match(name, owners)
        if hit is None:
            yield name, tensor
            continue
        attn, kind = hit
        if kind is None:
            continue
        if tensor.numel() != 1:
            raise ValueError(f"checkpoint tensor {name!r}: a per-tensor K/V cache scale must hold "
                             f"one value, got shape {tuple(tensor.shape)}")
        value = float(tensor.float().item())  # NOTE: a host tensor from safetensors: no sync
        for which in ("k", "v") if kind == "kv" else (kind,):
            attn.set_kv_scale(which, value, source=f"checkpoint tensor {name!r}")
        seen += 1
    if seen:
        logger.info("read %d K/V cache scale tensor(s) from the checkpoint (used by an FP8 "
                    "KV cache)", seen)


def _match(name: str, owners: dict[str, nn.Module]):
    """(Attention, "k" | "v" | "kv" | None to drop) when `name` is a scale of an attention
    module's cache, else None."""
    ours = name[len("model."):] if name.startswith("model.") else name
    for table in (KV_SCALE_SUFFIXES, dict.fromkeys(IGNORED_SUFFIXES)):
        for suffix, kind in table.items():
            if ours.endswith("." + suffix):
                parent = ours[:-len(suffix) - 1]
                if parent in owners:
                    return owners[parent], kind
    return None
