"""Process group state: the tensor-parallel group of this rank's pipeline stage, and the stage's
neighbours. One rank, one stage unless `init_tensor_parallel` / `init_worker_group` was called.

Layout: global rank = pp_rank * tp_size + tp_rank. Tensor-parallel rank r of stage s sends its
stage's output (hidden states and residual) to tensor-parallel rank r of stage s + 1.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None
_PP_RANK, _PP_SIZE, _TP_WIDTH = 0, 1, 1  # this rank's stage, the stages, ranks per stage
# The one-shot all-reduce over peer GPU memory for small messages (peer_all_reduce.py), or None.
_PEER = None


def init_tensor_parallel(group: dist.ProcessGroup | None = None) -> None:
    """Use `group` (default: the whole world) as the tensor-parallel group."""
    global _TP_GROUP
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before init_tensor_parallel")
    _TP_GROUP = group or dist.group.WORLD


def init_worker_group(rank: int, world_size: int, store: dist.Store, device: torch.device,
                      timeout_s: float = 600.0, pipeline_parallel_size: int = 1,
                      peer_all_reduce: bool = True) -> None:
    """Join the workers' process group (NCCL on CUDA, gloo on the CPU) as `rank`; with
    pipeline_parallel_size stages, each stage's world_size / stages ranks form its
    tensor-parallel group. On CUDA with peer_all_reduce, small all-reduces of the
    tensor-parallel group run over peer memory where every rank can map the others'."""
    global _PP_RANK, _PP_SIZE, _TP_WIDTH, _PEER
    pp = pipeline_parallel_size
    if pp < 1 or world_size % pp:
        raise ValueError(f"{world_size} ranks do not split into {pp} pipeline stages")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    tp = world_size // pp
    if pp == 1:
        init_tensor_parallel()
    else:
        # NOTE: every rank creates every stage's group, in the same order (new_group is collective).
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
        init_tensor_parallel(groups[rank // tp])
    _PP_RANK, _PP_SIZE, _TP_WIDTH = rank // tp, pp, tp
    _PEER = None
    if device.type == "cuda" and tp > 1 and peer_all_reduce:
        from peregrine.peer_all_reduce import PeerAllReduce
        _PEER = PeerAllReduce.create(_TP_GROUP, device)


def tp_size() -> int:
    return 1 if _TP_GROUP is None else dist.get_world_size(_TP_GROUP)


def tp_rank() -> int:
    return 0 if _TP_GROUP is None else dist.get_rank(_TP_GROUP)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group (in place); identity at world size 1."""
    if _TP_GROUP is not None and tp_size() > 1:
        if _PEER is not None and _PEER.fits(x):
            return _PEER.all_reduce(x)
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate `x` from every rank along `dim`; identity at world size 1."""
    if _TP_GROUP is None or tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def pp_rank() -> int:
    return _PP_RANK


def pp_size() -> int:
    return _PP_SIZE


def pp_send(x: torch.Tensor) -> dist.Work | None:
    """Start sending `x` to the next stage's rank of this tensor-parallel rank; the returned work
    must be waited on (and `x` kept alive) before `x` is reused."""
    if _PP_RANK + 1 >= _PP_SIZE:
        raise RuntimeError("the last pipeline stage has no next stage to send to")
    return dist.isend(x.contiguous(), dist.get_rank() + _TP_WIDTH)


def pp_recv(out: torch.Tensor) -> torch.Tensor:
    """Receive the previous stage's tensor into `out` (its shape and dtype known from the step)."""
    if _PP_RANK == 0:
        raise RuntimeError("the first pipeline stage has no previous stage to receive from")
    dist.recv(out, dist.get_rank() - _TP_WIDTH)
    return out


def divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor-parallel size ({b})")
    return a // b
