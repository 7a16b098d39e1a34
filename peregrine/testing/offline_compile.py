"""Compiling the CUDA kernels for a Hopper GPU on a machine without one: inside
`offline_compile()`, every Triton or Gluon kernel launch compiles for sm_90a (Triton's own
front end, the ptxas its wheel bundles) and returns without running. A Triton release that
changes an API the kernels use fails here, on the CPU, as it would at a GPU's first call."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch


class _OfflineDriver:
    """Just enough of a driver for Triton to compile for sm_90a (never to launch)."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextlib.contextmanager
def offline_compile() -> Iterator[list]:
    """Inside: `kernel[grid](...)` compiles the kernel for sm_90a and appends the compiled
    kernel (its `asm` holds "ptx" and "cubin") to the list this yields, and runs nothing. With
    TRITON_INTERPRET=1, Triton kernels are the interpreter's and are left out (Gluon kernels
    still compile)."""
    from triton.runtime import driver
    from triton.runtime.jit import KernelInterface

    compiled: list = []
    launch = KernelInterface.__getitem__

    def compile_only(self, grid):
        def run(*args, **kwargs):
            kernel = self.run(*args, grid=grid, warmup=True, **kwargs)
            if kernel is not None:  # (None: a kernel the interpreter would run)
                compiled.append(kernel)
        return run

    previous = driver._active  # (None where no driver was needed yet)
    driver.set_active(_OfflineDriver())
    KernelInterface.__getitem__ = compile_only
    try:
        yield compiled
    finally:
        KernelInterface.__getitem__ = launch
        driver._active = previous


def resources(kernel) -> dict:
    """A compiled kernel's registers a thread, spilled bytes (stores, loads) and shared memory,
    from the cubin (cuobjdump, bundled with Triton)."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(kernel.asm["cubin"])
        text = subprocess.run([str(tool), "-res-usage", path], capture_output=True, text=True,
                              check=True).stdout
    field = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}
    return {"registers": field.get("REG", 0), "local_bytes": field.get("LOCAL", 0),
            "stack_bytes": field.get("STACK", 0), "shared_bytes": int(kernel.metadata.shared)}
