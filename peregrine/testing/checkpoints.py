"""Tiny deterministic HF-format checkpoints (llama, llama3, mistral, qwen2, qwen3) built locally."""
from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# NOTE: the writer lives in the product package (the demo model needs it); names are re-exported
# here for the tests.
from peregrine.demo.checkpoint import (  # noqa: F401
    BOS_ID, EOS_ID, IM_END_ID, IM_START_ID, PAD_ID, init_weights_for_generation, make_config,
    output_row_scale, write_checkpoint)

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
TINY_VOCAB_SIZE = 512

_TINY_COMMON: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=TINY_VOCAB_SIZE, max_position_embeddings=512,
    rms_norm_eps=1e-6, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    tie_word_embeddings=False,
)
# NOTE: rope settings use the legacy rope_theta / rope_scaling kwargs, which transformers 4.x and
# 5.x both accept (5.x folds them into rope_parameters).
_TINY_ARCH: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", dict(rope_theta=10000.0)),
    # NOTE: original_max_position_embeddings=64 makes the llama3 frequency remap touch the
    # head_dim=16 frequencies with wavelengths > 16 tokens, i.e. it matters at test lengths.
    "llama3": ("LlamaForCausalLM", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "mistral": ("MistralForCausalLM", dict(rope_theta=1000000.0, sliding_window=None, head_dim=16)),
    "qwen2": ("Qwen2ForCausalLM", dict(rope_theta=1000000.0, use_sliding_window=False,
                                       sliding_window=None)),
    "qwen3": ("Qwen3ForCausalLM", dict(rope_theta=1000000.0, head_dim=32, attention_bias=False,
                                       tie_word_embeddings=True, use_sliding_window=False,
                                       sliding_window=None)),
}


def tiny_config(arch: str, **config_overrides: Any) -> PretrainedConfig:
    """The tiny transformers config for `arch` (one of ARCHS), with overrides applied."""
    if arch not in _TINY_ARCH:
        raise ValueError(f"unknown arch {arch!r} (expected one of {', '.join(ARCHS)})")
    architecture, extra = _TINY_ARCH[arch]
    kwargs = {**_TINY_COMMON, **extra, **config_overrides}
    return make_config(architecture, **kwargs)


def build_tiny_checkpoint(out_dir: str | Path, arch: str, *, dtype: torch.dtype = torch.float32,
                          num_shards: int = 1, with_tokenizer: bool = True, seed: int = 0,
                          **config_overrides: Any) -> Path:
    """Write a tiny `arch` checkpoint (config, safetensors, generation config, tokenizer)."""
    config = tiny_config(arch, **config_overrides)
    # NOTE: the weights do not depend on with_tokenizer (the tokenizer shapes the lm_head init).
    tok_vocab: int | None = TINY_VOCAB_SIZE
    if int(config.vocab_size) < TINY_VOCAB_SIZE:
        if with_tokenizer:
            raise ValueError(f"vocab_size {config.vocab_size} is smaller than the tokenizer's "
                             f"{TINY_VOCAB_SIZE}; pass with_tokenizer=False for such a model")
        tok_vocab = None
    return write_checkpoint(out_dir, config, dtype=dtype, num_shards=num_shards, seed=seed,
                            tokenizer_vocab_size=tok_vocab, save_tokenizer=with_tokenizer)


_cache_lock = threading.Lock()
_cache: dict[str, Path] = {}
_cache_root: Path | None = None


def _cache_key(arch: str, kw: dict[str, Any]) -> str:
    blob = json.dumps({"arch": arch, **kw}, sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tiny_checkpoint(arch: str, **kw: Any) -> Path:
    """build_tiny_checkpoint(arch, **kw), built once per process into a temp dir; do not modify."""
    global _cache_root
    key = _cache_key(arch, kw)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
        if _cache_root is None:
            _cache_root = Path(tempfile.mkdtemp(prefix="peregrine-ckpt-"))
            atexit.register(shutil.rmtree, _cache_root, True)
        path = build_tiny_checkpoint(_cache_root / f"{arch}-{key}", arch, **kw)
        _cache[key] = path
        return path
