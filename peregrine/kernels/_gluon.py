"""Helpers shared by the Gluon kernels (Triton's explicit-layout dialect, CUDA only)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.language.core import builtin

# Names Gluon changed between Triton 3.6 and 3.8 (the newer name where this Triton has it):
# the barrier of a program's threads (thread_barrier, barrier);
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# a cp.async copy of pointers' values into shared memory (async_copy_global_to_shared,
# async_load);
cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# a TMA copy of a descriptor's box into shared memory, completing on an mbarrier (the same).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@builtin
def smem_reinterpret(desc, dtype, shape, layout, _semantic=None):
    """The shared memory of desc seen as another dtype, shape and layout (the descriptor's
    `_reinterpret` in Triton 3.6 and 3.8, `reinterpret` in 3.9)."""
    view = getattr(desc, "reinterpret", None) or desc._reinterpret
    return view(dtype, shape, layout, _semantic=_semantic)


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


@gluon.jit
def poll_acquire(ptr):
    """The int32 at ptr, read with acquire semantics at GPU scope (a flag or counter another
    program releases)."""
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def poll_acquire4(ptr):
    """poll_acquire of four int32 at once: one 16-byte acquire load (GPU scope) for each run of
    four consecutive elements a thread holds, at the first one's address (which must be a
    multiple of 16 bytes; the others' pointers are not read)."""
    return gl.inline_asm_elementwise(
        "ld.acquire.gpu.global.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l,l,l,l", [ptr],
        dtype=gl.int32, is_pure=False, pack=4)


@gluon.jit
def ticket_release(ptr, flag):
    """A release increment of the counter at ptr in the threads whose flag is nonzero: the count
    before it (-1 in the other threads). An `inc` with a bound it never reaches, written out,
    so that nothing waits for the value until it is used (an `add` is aggregated over the warp
    by ptxas, whose shuffle of the old value waits for it at once)."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, -1; "
        "@p atom.release.gpu.global.inc.u32 $0, [$1], 2147483647; }", "=r,l,r", [ptr, flag],
        dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def fence_acq_rel_gpu_if(flag):
    """fence.acq_rel.gpu in the threads whose flag (an int32 tensor) is nonzero: after a release
    atomic whose value says other programs' writes are done, an acquire fence, so that those
    writes are visible to what follows a barrier with this thread; or before relaxed atomics,
    one release for all of them (each release atomic would be a fence of its own)."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $1, 0; @p fence.acq_rel.gpu; mov.b32 $0, 0; }", "=r,r",
        [flag], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def trap():
    """Abort the launch (the kernel fails with an error rather than hanging the GPU)."""
    gl.inline_asm_elementwise("trap; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def wait_count(ptr, target, LIMIT: gl.constexpr = 1 << 26):
    """Spin until the int32 counter at ptr (acquire loads, GPU scope) reaches target. A wait
    longer than LIMIT polls (seconds, where a phase takes microseconds: a program that never
    arrives) traps, so that the launch fails with an error instead of hanging the GPU."""
    seen = poll_acquire(ptr)
    n = 0
    while seen < target:
        seen = poll_acquire(ptr)
        n += 1
        if n > LIMIT:
            trap()


# thread 0's spin on a counter (see wait_count_one): the other threads skip it; a wait past
# 2^26 polls traps, as wait_count's does
_SPIN_ONE = gl.constexpr(
    "{ .reg .pred p; .reg .b32 v; .reg .u32 n; mov.u32 n, 0; setp.ne.b32 p, $1, 0; "
    "@!p bra SPIN_END${:uid}; SPIN_TOP${:uid}: ld.acquire.gpu.global.b32 v, [$2]; "
    "setp.lt.s32 p, v, $3; @!p bra SPIN_END${:uid}; add.u32 n, n, 1; "
    "setp.gt.u32 p, n, 67108864; @p trap; bra SPIN_TOP${:uid}; SPIN_END${:uid}: "
    "mov.b32 $0, 0; }")


@gluon.jit
def wait_count_one(ptr, target, idx):
    """As wait_count, but one thread polls (idx: a tensor of the threads' indices; the one at
    0), so that a program has one acquire load in flight at the counter's L2 line, not one a
    warp, and the other threads wait for it at a barrier of the program's threads (which
    passes the acquire on to them, as after _settle's fence)."""
    gl.inline_asm_elementwise(_SPIN_ONE, "=r,r,l,r", [(idx == 0).to(gl.int32), ptr + idx * 0,
                                                    idx * 0 + target],
                              dtype=gl.int32, is_pure=False, pack=1)
    cta_barrier()


@gluon.jit
def globaltimer():
    """The GPU's nanosecond clock (%globaltimer), for timelines."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def ring_barriers(S: gl.constexpr):
    """A shared-memory ring's S slots' barriers, initialised: `ready` (a chunk landed) and
    `empty` (its slot may be refilled), one arrival each."""
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(S):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    return ready, empty
