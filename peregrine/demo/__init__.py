"""The built-in demo model: a small Llama trained on the Python standard library, shipped in the
package with a much smaller draft model of the same tokenizer (docs/DEMO_MODEL.md)."""
from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
MODEL_FOLDER, DRAFT_FOLDER = "model", "draft"
# What a packaged folder must hold for the engine and the tokenizer to load it.
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json")


def _packaged(folder: str) -> Path:
    path = DEMO_DIR / folder
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise ValueError(
            f"the demo model folder {path} lacks {', '.join(missing)}; reinstall peregrine, or "
            f"train it with `python benchmarks/train_demo.py --out-dir OUT` and copy "
            f"OUT/demo-{folder} there (or pass a model)")
    return path


def demo_model_path() -> Path:
    """Folder of the packaged demo model (HF format, bf16, byte-level BPE with a chat template)."""
    return _packaged(MODEL_FOLDER)


def demo_draft_path() -> Path:
    """Folder of the packaged draft model: same tokenizer, far fewer parameters."""
    return _packaged(DRAFT_FOLDER)
