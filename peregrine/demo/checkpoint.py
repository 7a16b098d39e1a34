"""Writing small deterministic HF-format checkpoints (random weights shaped for generation)."""
from __future__ import annotations

import json
import math
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

from peregrine.demo.tokenizer import SPECIAL_TOKENS, build_bpe_tokenizer, token_texts

BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = range(len(SPECIAL_TOKENS))

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def make_config(architecture: str, **kwargs: Any) -> PretrainedConfig:
    """A transformers config for `architecture` (e.g. "LlamaForCausalLM") built from kwargs."""
    import transformers

    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}.get(architecture)
    if model_type is None:
        raise ValueError(f"unsupported architecture {architecture!r}")
    return transformers.AutoConfig.for_model(model_type, architectures=[architecture], **kwargs)


def output_row_scale(vocab_size: int, tokenizer_vocab_size: int | None) -> torch.Tensor:
    """Per-token lm_head row scale: control bytes, partial UTF-8 and padding rows are damped."""
    # NOTE: a random model emits every byte token equally often; damping control characters
    # (and, less, lone UTF-8 fragments and bos/pad/im_start) makes greedy text mostly printable
    # while multi-byte fragments and eos/im_end still show up now and then.
    scale = torch.full((vocab_size,), 0.25)  # (V,)
    if tokenizer_vocab_size is None:
        return torch.ones(vocab_size)
    texts = token_texts(tokenizer_vocab_size)
    for i, text in enumerate(texts[:vocab_size]):
        if i < len(SPECIAL_TOKENS):
            scale[i] = 0.6 if i in (EOS_ID, IM_END_ID) else 0.25
        elif any(unicodedata.category(c) == "Cc" and c not in "\n\t" for c in text):
            scale[i] = 0.25
        elif "\ufffd" in text:
            scale[i] = 0.6
        else:
            scale[i] = 1.0
    return scale


@torch.no_grad()
def init_weights_for_generation(model: torch.nn.Module, seed: int,
                                row_scale: torch.Tensor | None = None) -> None:
    """Re-initialise every parameter deterministically so greedy decoding is not degenerate."""
    # NOTE: with the usual 0.02 init the residual stream is dominated by the current token's
    # embedding, logits are near-uniform (tiny top-1/top-2 gaps, so numerics flip argmax) and
    # greedy text loops. Here layers get gain-2 projections so attention/MLP outputs outweigh
    # the embedding, and logits get std ~4 (hidden-size independent) via lm_head std 4/sqrt(H)
    # (untied) or a small tied embedding 2/sqrt(H) with a final-norm gain of 2. Norm weights
    # are 1 + noise and biases non-zero, so a loader that drops them gives different logits.
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    gen = torch.Generator().manual_seed(seed)
    inv_sqrt_h = 1.0 / math.sqrt(model.get_input_embeddings().weight.shape[1])

    def normal(shape: torch.Size, std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(shape, generator=gen, dtype=torch.float32)

    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("embed_tokens.weight"):
            value = normal(p.shape, 2.0 * inv_sqrt_h if tied else 0.5)
        elif name == "lm_head.weight":
            value = normal(p.shape, 4.0 * inv_sqrt_h)
        elif name == "model.norm.weight":
            value = normal(p.shape, 0.2 if tied else 0.1, mean=2.0 if tied else 1.0)
        elif "norm" in name:
            value = normal(p.shape, 0.1, mean=1.0)
        elif name.endswith(".bias"):
            value = normal(p.shape, 0.1)
        elif p.dim() == 2:
            value = normal(p.shape, 2.0 / math.sqrt(p.shape[1]))
        else:
            raise AssertionError(f"no init rule for parameter {name} {tuple(p.shape)}")
        if row_scale is not None and (name == "lm_head.weight" or
                                      (tied and name.endswith("embed_tokens.weight"))):
            value = value * row_scale[:, None]
        p.copy_(value.to(p.dtype))


def _portable_config(cfg: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    # NOTE: transformers 5 writes rope_parameters and dtype; hub checkpoints (and transformers 4)
    # use rope_theta / rope_scaling and torch_dtype. Write both so either reader finds them.
    cfg = dict(cfg)
    cfg["torch_dtype"] = cfg["dtype"] = _DTYPE_NAMES[dtype]
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        rope = dict(rope)
        theta = rope.pop("rope_theta", None)
        if theta is not None:
            cfg.setdefault("rope_theta", theta)
        cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    return cfg


def _split_shards(out: Path, num_shards: int) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    single = out / "model.safetensors"
    with safe_open(str(single), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in sorted(f.keys())}
    if num_shards > len(tensors):
        raise ValueError(f"num_shards {num_shards} > number of tensors {len(tensors)}")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    names = list(tensors)
    size = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    # Contiguous split balanced by bytes; every shard gets at least one tensor.
    groups: list[list[str]] = []
    start, acc = 0, 0
    for k in range(num_shards):
        if k == num_shards - 1:
            groups.append(names[start:])
            break
        end, acc = start + 1, acc + size[names[start]]
        last_end = len(names) - (num_shards - 1 - k)
        target = total * (k + 1) / num_shards
        while end < last_end and acc + size[names[end]] <= target:
            acc += size[names[end]]
            end += 1
        groups.append(names[start:end])
        start = end
    assert all(groups) and sum(map(len, groups)) == len(names)
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in group}, str(out / fname),
                  metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    single.unlink()


def save_model_folder(model: torch.nn.Module, out_dir: str | Path, dtype: torch.dtype, *,
                      num_shards: int = 1) -> Path:
    """Save a transformers causal LM in `dtype` as an HF folder any reader takes (no tokenizer)."""
    from transformers.utils import logging as hf_logging

    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(_DTYPE_NAMES.values())}, got {dtype}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(dtype)
    model.config.dtype = dtype
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # NOTE: save_pretrained shows a shard progress bar
    try:
        model.save_pretrained(str(out))
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    if num_shards > 1:
        _split_shards(out, num_shards)
    cfg = _portable_config(json.loads((out / "config.json").read_text()), dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen_cfg = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    return out


def write_checkpoint(out_dir: str | Path, config: PretrainedConfig, *, dtype: torch.dtype = torch.float32,
                     num_shards: int = 1, seed: int = 0,
                     tokenizer_vocab_size: int | None = None,
                     save_tokenizer: bool = True) -> Path:
    """Build a model from `config`, init it for generation, and save an HF-format folder."""
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(_DTYPE_NAMES.values())}, got {dtype}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    row_scale = output_row_scale(int(config.vocab_size), tokenizer_vocab_size)
    init_weights_for_generation(model, seed, row_scale)
    out = save_model_folder(model, out_dir, dtype, num_shards=num_shards)
    if save_tokenizer and tokenizer_vocab_size is not None:
        cfg = json.loads((out / "config.json").read_text())
        build_bpe_tokenizer(out, tokenizer_vocab_size,
                            model_max_length=int(cfg.get("max_position_embeddings") or 2048))
    return out
