"""Where a model comes from: a folder, or a config.json-style file served with dummy weights."""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path


def model_folder(model: str) -> str:
    """A model folder, or a config.json-style file turned into a weightless folder for dummy
    weights (removed when the process exits)."""
    p = Path(model)
    if p.is_dir():
        return str(p)
    if p.is_file() and p.suffix == ".json":
        d = Path(tempfile.mkdtemp(prefix="peregrine-config-"))
        atexit.register(functools.partial(shutil.rmtree, d, ignore_errors=True))
        shutil.copy(p, d / "config.json")
        return str(d)
    if p.suffix == ".json":
        raise ValueError(f"--model {model!r}: no such config file")
    raise ValueError(f"--model {model!r} is neither a model folder nor a config .json file")
