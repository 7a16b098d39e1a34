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


_CAST = re.compile(r"\s*(%[\w#.]+) = arith\.(?:bitcast|extsi|extui|trunci|index_cast)\b")


def carried_bounds(ir: str) -> list[str]:
    """The values a `for` loop carries from one iteration to the next whose only use in the
    loop is as an inner loop's bound (through casts), in a kernel's IR as Triton's frontend
    wrote it (a compiled kernel's `asm["source"]`, Gluon; or its "ttir"). Triton 3.6's
    `tritongpu-remove-layout-conversions` drops such a value, so that the inner loop keeps the
    value from before the outer loop; Triton 3.9 compiles it correctly. Each as "line N:
    %name"."""
    lines = ir.splitlines()

    def indent(line: str) -> int:
        return len(line) - len(line.lstrip())

    def after(k: int, deeper: bool) -> range:
        """The lines after line k up to the end of its region (deeper: of its own body)."""
        floor = indent(lines[k]) + (1 if deeper else 0)
        end = k + 1
        while end < len(lines) and (not lines[end].strip() or indent(lines[end]) >= floor):
            end += 1
        return range(k + 1, end)

    def uses(name: str, where: range, depth: int = 0) -> list[tuple[str, str]]:
        """(name, line) for every use of name in where, followed through casts."""
        out = []
        pattern = re.compile(re.escape(name) + r"(?![\w#.])")
        for q in where:
            if not pattern.search(lines[q]):
                continue
            cast = _CAST.match(lines[q])
            if cast and depth < 4:
                out += uses(cast.group(1), after(q, False), depth + 1)
            else:
                out.append((name, lines[q]))
        return out

    found = []
    for k, line in enumerate(lines):
        if "scf.for" not in line or "iter_args(" not in line:
            continue
        for name in re.findall(r"(%[\w#.]+) = ", line.split("iter_args(", 1)[1]):
            seen = uses(name, after(k, True))
            bound = [u for n, u in seen if re.search(
                r"scf\.for %[\w#.]+ = " + re.escape(n) + r"(?![\w#.])|\bto " + re.escape(n)
                + r"(?![\w#.])", u)]
            if seen and len(bound) == len(seen):
                found.append(f"line {k + 1}: {name}")
    return found
