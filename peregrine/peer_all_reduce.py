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

    def __init__(self, rank: int, world: int, device: torch.device,
                 mapped: list[tuple[int, int]], slot_bytes: int) -> None:
        """mapped: every rank's (buffer, signals) address on this GPU, this rank's included."""
        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        self.buffers = torch.tensor([b for b, _ in mapped], dtype=torch.int64, device=device)
        self.signals = torch.tensor([s for _, s in mapped], dtype=torch.int64, device=device)
        self.counters = torch.zeros(2, dtype=torch.int64, device=device)

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
        allocated: list[int] = []  # this rank's buffer and signals, as far as they got
        opened: list[int] = []  # the peers' allocations mapped here, as far as they got
        handles: tuple[bytes, bytes] | str
        try:
            rt = cuda_runtime()
            for nbytes in (2 * world * slot_bytes, world * MAX_PROGRAMS * 8):
                allocated.append(rt.malloc_zeroed(nbytes))
            handles = (rt.ipc_handle(allocated[0]), rt.ipc_handle(allocated[1]))
        except (OSError, RuntimeError, AttributeError) as e:
            handles = f"{type(e).__name__}: {e}"
        every: list = [None] * world
        dist.all_gather_object(every, handles, group=group)
        problem = next((f"rank {q}: {h}" for q, h in enumerate(every) if isinstance(h, str)), None)
        if problem is None:
            try:
                for q, pair in enumerate(every):
                    if q != rank:
                        for handle in pair:
                            opened.append(rt.open_ipc_handle(handle))
            except (RuntimeError, ValueError) as e:
                problem = f"rank {rank}: {e}"
        problems: list = [None] * world
        dist.all_gather_object(problems, problem, group=group)
        problem = next((p for p in problems if p is not None), None)
        if problem is not None:
            _release(allocated, opened)
            logger.info("tensor-parallel all-reduce: NCCL (peer memory could not be mapped: %s)",
                        problem)
            return None
        peers = iter(zip(opened[0::2], opened[1::2]))
        mapped = [(allocated[0], allocated[1]) if q == rank else next(peers)
                  for q in range(world)]
        logger.info("tensor-parallel all-reduce: one-shot over peer memory up to %d KiB, NCCL "
                    "above", slot_bytes >> 10)
        return cls(rank, world, device, mapped, slot_bytes)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.numel() * x.element_size() <= self.slot_bytes
                and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
                and x.is_contiguous())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place (x must `fit`)."""
        from peregrine.kernels.all_reduce import one_shot_all_reduce
        return one_shot_all_reduce(x, x, self.buffers, self.signals, self.counters, self.rank,
                                   self.world, self.slot_bytes // x.element_size())


def _release(allocated: list[int], opened: list[int]) -> None:
    """Unmap the peers' allocations and free this rank's."""
    if not allocated and not opened:
        return
    from peregrine.cuda_ipc import cuda_runtime
    rt = cuda_runtime()
    for ptr in opened:
        rt.close_ipc_handle(ptr)
    for ptr in allocated:
        rt.free(ptr)
