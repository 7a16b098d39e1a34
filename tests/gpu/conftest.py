"""GPU tests: every module here is marked `gpu` (run with `pytest -m gpu`); seeded per test."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """The same random inputs for a test however many tests ran before it."""
    torch.manual_seed(0)
