"""Tensor-parallel process group state. World size 1 unless `init_tensor_parallel` was called."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None


def init_tensor_parallel(group: dist.ProcessGroup | None = None) -> None:
    """Use `group` (default: the whole world) as the tensor-parallel group."""
    global _TP_GROUP
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before init_tensor_parallel")
    _TP_GROUP = group or dist.group.WORLD


def init_worker_group(rank: int, world_size: int, store: dist.Store, device: torch.device,
                      timeout_s: float = 600.0) -> None:
    """Join the workers' process group (NCCL on CUDA, gloo on the CPU) as `rank`; it becomes the
    tensor-parallel group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    init_tensor_parallel()


def tp_size() -> int:
    return 1 if _TP_GROUP is None else dist.get_world_size(_TP_GROUP)


def tp_rank() -> int:
    return 0 if _TP_GROUP is None else dist.get_rank(_TP_GROUP)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group (in place); identity at world size 1."""
    if _TP_GROUP is not None and tp_size() > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate `x` from every rank along `dim`; identity at world size 1."""
    if _TP_GROUP is None or tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor-parallel size ({b})")
    return a // b
