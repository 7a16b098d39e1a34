"""Run a function on several CPU processes joined in one gloo tensor-parallel group (tests only)."""
from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def run_on_gloo_ranks(fn: Callable[..., Any], world: int, *args: Any) -> Any:
    """fn(*args) on `world` spawned processes in one tensor-parallel group; rank 0's result.

    fn must be importable by name (a module-level function): spawned processes import it.
    """
    out = mp.get_context("spawn").Manager().dict()
    mp.start_processes(_rank_main, args=(world, _free_port(), fn, args, out), nprocs=world,
                       start_method="spawn")
    return out["result"]


def _rank_main(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple,
               out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from peregrine.distributed import init_tensor_parallel, tp_size
    init_tensor_parallel()
    if tp_size() != world:
        raise RuntimeError(f"tensor-parallel group of {tp_size()}, expected {world}")
    result = fn(*args)
    if rank == 0:
        out["result"] = result
    # NOTE: both ranks leave together, then exit without running gloo's C++ teardown, which can
    # abort ("terminate called without an active exception") when the peer is already gone.
    dist.barrier()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
