"""The tensor-parallel group's all-reduce over peer GPU memory (kernels/all_reduce.py) for
messages up to SLOT_BYTES; larger ones, and groups where peer memory cannot be mapped, use NCCL.

At batch-one decode a Llama layer all-reduces two messages of hidden_size elements (8 KiB for
Llama-3-8B); NCCL's latency per call, not bandwidth, is then the cost, which one kernel that
writes into the peers' memory and waits for their flags avoids."""
from __future__ import annotations

import logging
import socket

import torch
import torch.distributed as dist

logger = logging.getLogger("peregrine")

# The largest message (bytes) the one-shot kernel takes: a decode step's layer output up to
# 256 sequences x 8192 hidden in 16 bits (4 MiB). Each rank's buffer holds two halves of one
# slot per rank.
SLOT_BYTES = 4 << 20


class PeerAllReduce:
    """Buffers mapped on every rank of a tensor-parallel group, and the one-shot kernel's
    launch. Build with `PeerAllReduce.create`, which every rank of the group calls together."""

    def __init__(self, rank: int, world: int, device: torch.device, own: tuple[int, int],
                 mapped: list[tuple[int, int]], slot_bytes: int) -> None:
        from peregrine.kernels.all_reduce import MAX_PROGRAMS
        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        self._own = own  # (buffer, signals) allocated here
        self._mapped = [m for q, m in enumerate(mapped) if q != rank]  # opened peers' handles
        self.buffers = torch.tensor([b for b, _ in mapped], dtype=torch.int64, device=device)
        self.signals = torch.tensor([s for _, s in mapped], dtype=torch.int64, device=device)
        self.counters = torch.zeros(2, dtype=torch.int64, device=device)
        self.max_programs = MAX_PROGRAMS

    @classmethod
    def create(cls, group: dist.ProcessGroup, device: torch.device,
               slot_bytes: int = SLOT_BYTES) -> PeerAllReduce | None:
        """Allocate this rank's buffers, exchange IPC handles and map the peers'. Every rank of
        `group` must call it; all of them return an instance, or all None (with the reason
        logged) when any rank cannot map a peer's memory or the ranks are on several hosts."""
        from peregrine.cuda_ipc import cuda_runtime
        from peregrine.kernels.all_reduce import MAX_PROGRAMS
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        hosts: list = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) > 1:
            logger.info("tensor-parallel all-reduce: NCCL (the ranks are on %d hosts)",
                        len(set(hosts)))
            return None
        own: tuple[int, int] | None = None
        handles: tuple[bytes, bytes] | str
        try:
            rt = cuda_runtime()
            buf = rt.malloc_zeroed(2 * world * slot_bytes)
            sig = rt.malloc_zeroed(world * MAX_PROGRAMS * 8)
            own = (buf, sig)
            handles = (rt.ipc_handle(buf), rt.ipc_handle(sig))
        except (OSError, RuntimeError, AttributeError) as e:
            handles = f"{type(e).__name__}: {e}"
        every: list = [None] * world
        dist.all_gather_object(every, handles, group=group)
        mapped: list[tuple[int, int]] = []
        problem = next((f"rank {q}: {h}" for q, h in enumerate(every) if isinstance(h, str)), None)
        if problem is None:
            try:
                for q, (hb, hs) in enumerate(every):
                    mapped.append(own if q == rank else
                                  (rt.open_ipc_handle(hb), rt.open_ipc_handle(hs)))
            except RuntimeError as e:
                problem = f"rank {rank}: {e}"
        problems: list = [None] * world
        dist.all_gather_object(problems, problem, group=group)
        problem = next((p for p in problems if p is not None), None)
        if problem is not None:
            _release(own, [m for q, m in enumerate(mapped) if q != rank])
            logger.info("tensor-parallel all-reduce: NCCL (peer memory could not be mapped: %s)",
                        problem)
            return None
        logger.info("tensor-parallel all-reduce: one-shot over peer memory up to %d KiB, NCCL "
                    "above", slot_bytes >> 10)
        return cls(rank, world, device, own, mapped, slot_bytes)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.numel() * x.element_size() <= self.slot_bytes
                and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
                and x.is_contiguous())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place (x must `fit`)."""
        from peregrine.kernels.all_reduce import one_shot_all_reduce
        return one_shot_all_reduce(x, x, self.buffers, self.signals, self.counters, self.rank,
                                   self.world, self.slot_bytes // x.element_size())

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (no kernel may be running on them)."""
        _release(self._own, self._mapped)
        self._own, self._mapped = None, []


def _release(own: tuple[int, int] | None, mapped: list[tuple[int, int]]) -> None:
    if own is None and not mapped:
        return
    from peregrine.cuda_ipc import cuda_runtime
    rt = cuda_runtime()
    for ptrs in mapped:
        for p in ptrs:
            rt.close_ipc_handle(p)
    if own is not None:
        for p in own:
            rt.free(p)
