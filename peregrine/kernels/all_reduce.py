"""A one-shot all-reduce over peer GPU memory, for small tensor-parallel messages (a decode
step's layer outputs), where a collective library's latency is the cost.

Every rank holds one buffer that all ranks can write (mapped through CUDA IPC, cuda_ipc.py):
two halves, each with one slot per rank, and beside it a signal area of one 64-bit word per
(source rank, program). Program p of each rank:
  1. writes its piece of the input into slot `rank` of every rank's buffer (the half that this
     call's epoch selects),
  2. after a block-wide barrier, writes the epoch into every rank's signal word (rank, p) with
     release semantics at system scope (the piece is visible before the flag),
  3. waits until each rank's signal word (q, p) of its own signal area reaches the epoch
     (acquire), then
  4. sums the slots in rank order (so every rank gets the same bits) and writes the output.
The epoch counts the calls; it lives on this GPU (every program reads it as it starts, the last
program to finish advances it), so a captured CUDA graph replays correctly, and all ranks make
the same calls in the same order, so their counts agree. The two halves make the call safe
without a closing barrier: a rank starts call e + 2, which rewrites the half of call e, only
after it has seen every rank's signal of call e + 1, which each rank gives after it has
finished call e (its calls run in order on its stream).

The grid never exceeds MAX_PROGRAMS, fewer than the SMs, so that every program of the kernel is
resident at once on every GPU (a program waits for the same program on the other GPUs)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Programs of one call, at most (each spins until its peers' programs arrive, so all must fit on
# the GPU at once), and elements each program moves per loop step.
MAX_PROGRAMS = 64
BLOCK = 1024


@triton.jit
def _one_shot_all_reduce_kernel(
    x_ptr, out_ptr, n, iters, buffers_ptr, signals_ptr, counters_ptr, rank, slot_elems,
    WORLD: tl.constexpr, MAXP: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    elem = x_ptr.dtype.element_ty
    epoch = tl.load(counters_ptr, cache_modifier=".cg") + 1  # int64: this call's number
    half = epoch % 2
    start = pid.to(tl.int64) * iters * BLOCK
    # 1. this rank's piece into slot `rank` of every rank's buffer
    for i in range(iters):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        for q in tl.static_range(WORLD):
            # NOTE: the buffers are cudaMalloc'd (256-byte aligned); saying so lets the copies
            # use 16-byte accesses.
            buf = tl.load(buffers_ptr + q).to(tl.pointer_type(elem))
            dst = tl.multiple_of(buf + (half * WORLD + rank) * slot_elems + offs, 16)
            tl.store(dst, x, mask=mask)
    tl.debug_barrier()
    # 2. the piece is there: one flag per rank
    for q in tl.static_range(WORLD):
        sig = tl.load(signals_ptr + q).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(sig + rank * MAXP + pid, epoch, sem="release", scope="sys")
    # 3. every rank's piece is here
    own_sig = tl.load(signals_ptr + rank).to(tl.pointer_type(tl.int64))
    for q in tl.static_range(WORLD):
        seen = tl.atomic_add(own_sig + q * MAXP + pid, 0, sem="acquire", scope="sys")
        while seen < epoch:
            seen = tl.atomic_add(own_sig + q * MAXP + pid, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    # 4. the sum, in rank order on every rank
    own = tl.load(buffers_ptr + rank).to(tl.pointer_type(elem))
    for i in range(iters):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for q in tl.static_range(WORLD):
            src = tl.multiple_of(own + (half * WORLD + q) * slot_elems + offs, 16)
            v = tl.load(src, mask=mask, other=0.0, cache_modifier=".cg")
            acc += v.to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    # 5. the last program to finish advances the call count (each read it before counting in)
    finished = tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if finished == tl.num_programs(0) - 1:
        tl.atomic_xchg(counters_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counters_ptr, epoch, sem="release", scope="gpu")


def one_shot_all_reduce(x: torch.Tensor, out: torch.Tensor, buffers: torch.Tensor,
                        signals: torch.Tensor, counters: torch.Tensor, rank: int, world: int,
                        slot_elems: int) -> torch.Tensor:
    """out = the sum of x over the ranks (out may be x). buffers / signals: int64 (world,) device
    tensors of every rank's buffer and signal area as mapped on this GPU; counters: int64 (2,)
    on this GPU, zeros at first (the calls so far, the programs of this call that finished);
    slot_elems: elements of x's dtype that one slot holds."""
    n = x.numel()
    if n > slot_elems:
        raise ValueError(f"one_shot_all_reduce: {n} elements do not fit a slot of {slot_elems}")
    if not (x.is_contiguous() and out.is_contiguous() and out.shape == x.shape):
        raise ValueError("one_shot_all_reduce: x and out must be contiguous and of one shape")
    blocks = triton.cdiv(n, BLOCK)
    programs = min(MAX_PROGRAMS, blocks)
    iters = triton.cdiv(blocks, programs)
    _one_shot_all_reduce_kernel[(programs,)](
        x, out, n, iters, buffers, signals, counters, rank, slot_elems,
        WORLD=world, MAXP=MAX_PROGRAMS, BLOCK=BLOCK, num_warps=4)
    return out
