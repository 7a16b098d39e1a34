"""The benchmark scripts (benchmarks/*.py) as modules, for the tests that run them small on the CPU."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """benchmarks/<name>.py, imported once as the module `name`."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # NOTE: dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
