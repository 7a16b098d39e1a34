"""Product code never imports the test helpers (peregrine.testing)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import peregrine

PACKAGE = Path(peregrine.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_product_module_imports_peregrine_testing() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if PACKAGE / "testing" in path.parents:
            continue
        bad = {m for m in _imported_modules(path)
               if m == "peregrine.testing" or m.startswith("peregrine.testing.")}
        if bad:
            offenders.append(f"{path.relative_to(PACKAGE.parent)}: {sorted(bad)}")
    assert offenders == []


@pytest.mark.slow
def test_the_demo_model_and_its_training_load_no_test_helper() -> None:
    code = ("import sys; from peregrine.config import EngineArgs; import peregrine.demo as d; "
            "import peregrine.demo.train; d.demo_model_path; "
            "print(sorted(m for m in sys.modules if m.startswith('peregrine.testing')))")
    out = subprocess.run([sys.executable, "-c", code], check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == "[]"
