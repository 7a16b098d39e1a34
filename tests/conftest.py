"""Session-wide test setup: the demo model's cache, Triton's mode, and the gpu marker."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

# NOTE: the demo model is built on first use; keep test builds out of the user's ~/.cache.
os.environ.setdefault("PEREGRINE_CACHE_DIR", tempfile.mkdtemp(prefix="peregrine-test-cache-"))
# NOTE: without CUDA the kernels run under Triton's interpreter; with CUDA they run compiled. It
# must be set before any module imports triton (triton.jit reads it at decoration), and it holds
# for the whole process, so no other conftest may set it.
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Node ids of the CPU tests that hand CPU tensors to Triton kernels: they need the interpreter.
# NOTE: on a CUDA machine the kernels are compiled, so these are skipped there; tests/gpu runs the
# same kernels compiled on CUDA tensors (`pytest -m gpu`).
_INTERPRETER_TESTS = ("tests/kernels/", "triton", "test_fused_kernel_")


def _needs_interpreter(item: pytest.Item) -> bool:
    if item.get_closest_marker("gpu"):
        return False
    return any(s in item.nodeid for s in _INTERPRETER_TESTS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """gpu and ray tests: selected only when -m names them; gpu tests skipped without CUDA; tests
    that need the interpreter: skipped where the kernels are compiled."""
    markexpr = config.getoption("markexpr") or ""
    # NOTE: the CPU tiers (`pytest`, `pytest -m "not slow"`) never try the GPU tests, nor the Ray
    # tests (their own tier, `pytest -m ray`, with the ray extra installed).
    for tier in ("gpu", "ray"):
        if tier not in markexpr:
            out = [item for item in items if item.get_closest_marker(tier)]
            if out:
                config.hook.pytest_deselected(items=out)
                items[:] = [item for item in items if not item.get_closest_marker(tier)]
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    compiled = pytest.mark.skip(reason="hands CPU tensors to Triton kernels, which needs the "
                                       "interpreter (CPU-only machines); `pytest -m gpu` runs "
                                       "the compiled kernels here")
    for item in items:
        if item.get_closest_marker("gpu") and not HAS_CUDA:
            item.add_marker(no_cuda)
        elif not INTERPRETED and _needs_interpreter(item):
            item.add_marker(compiled)
