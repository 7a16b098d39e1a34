"""Where a model comes from: a folder, or a config.json-style file served with dummy weights."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def model_folder(model: str) -> str:
    """A model folder, or a config.json-style file turned into a weightless folder for dummy weights."""
    p = Path(model)
    if p.is_dir():
        return str(p)
    if p.is_file() and p.suffix == ".json":
        d = Path(tempfile.mkdtemp(prefix="peregrine-config-"))
        shutil.copy(p, d / "config.json")
        return str(d)
    raise ValueError(f"--model {model!r} is neither a model folder nor a config .json file")
