"""Helpers shared by the Gluon kernels (Triton's explicit-layout dialect, CUDA only)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def pdl_wait(PDL: gl.constexpr):
    """The programmatic-dependent-launch wait (see _utils.pdl_wait)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def pdl_release(PDL: gl.constexpr):
    """Let the next kernel be scheduled now (see _utils.pdl_release)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)
