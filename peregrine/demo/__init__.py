"""The built-in demo model: a small random-weight Llama checkpoint built locally on first use."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from peregrine import envs

logger = logging.getLogger(__name__)

# NOTE: bump the version whenever the recipe below (or the tokenizer corpus) changes, so a cached
# folder from an older recipe is never reused.
DEMO_MODEL_NAME = "demo-model-v1"
DEMO_VOCAB_SIZE = 2048
_DEMO_MARKER = "peregrine-demo.txt"


def _demo_config():
    from peregrine.demo.checkpoint import BOS_ID, EOS_ID, PAD_ID, make_config

    return make_config(
        "LlamaForCausalLM", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=768, vocab_size=DEMO_VOCAB_SIZE,
        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def build_demo_model(out_dir: str | Path) -> Path:
    """Write the demo checkpoint (bf16 weights, 2048-token BPE, chat template) to out_dir."""
    from peregrine.demo.checkpoint import write_checkpoint

    out = write_checkpoint(out_dir, _demo_config(), dtype=torch.bfloat16, seed=0,
                           tokenizer_vocab_size=DEMO_VOCAB_SIZE)
    (out / _DEMO_MARKER).write_text(f"{DEMO_MODEL_NAME}\n")
    return out


def demo_cache_root() -> Path:
    """Folder that holds the demo model: $PEREGRINE_CACHE_DIR or ~/.cache/peregrine."""
    env = envs.cache_dir()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "peregrine"


def _is_complete(path: Path) -> bool:
    marker = path / _DEMO_MARKER
    return marker.is_file() and marker.read_text().strip() == DEMO_MODEL_NAME


def demo_model_path() -> Path:
    """Path of the demo model folder, building it (atomically, once) if it is not cached yet."""
    root = demo_cache_root()
    final = root / DEMO_MODEL_NAME
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    if final.exists():
        # NOTE: only a hand-edited or foreign folder can be incomplete: builds land by rename.
        logger.warning("demo model folder %s is incomplete; rebuilding it", final)
        stale = Path(tempfile.mkdtemp(dir=root, prefix=f".{DEMO_MODEL_NAME}-stale-"))
        try:
            os.rename(final, stale / "old")
        except FileNotFoundError:
            pass  # another process moved it first
        shutil.rmtree(stale, ignore_errors=True)
    logger.info("building the demo model into %s (one time, a few seconds)", final)
    # NOTE: build into a private temp folder on the same filesystem, then rename: a concurrent
    # first use either wins the rename or finds the other's finished folder.
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{DEMO_MODEL_NAME}-tmp-"))
    try:
        build_demo_model(tmp)
        os.chmod(tmp, 0o755)  # NOTE: mkdtemp makes it 0700
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
