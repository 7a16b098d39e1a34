"""What every multi-worker executor does for one rank, wherever the rank runs (a spawned process, a
Ray actor): choose its device, join the workers' process group (its pipeline stage's
tensor-parallel group), build the Worker and size its KV cache; and what the driver does with the
sizes (one log line per rank, the minimum over ranks).

Rank layout (distributed.py): rank = pp_rank * tensor_parallel_size + tp_rank; the first rank of
the last pipeline stage returns each step's sampled tokens (`output_rank`)."""
from __future__ import annotations

import logging
import os
from typing import Any

from peregrine.config import EngineConfig

logger = logging.getLogger("peregrine")


def output_rank(config: EngineConfig) -> int:
    """The rank that returns each step's output: the first of the last pipeline stage."""
    return (config.pipeline_parallel_size - 1) * config.tensor_parallel_size


def describe_rank(config: EngineConfig, rank: int) -> str:
    """How errors and logs name a worker."""
    if config.pipeline_parallel_size == 1:
        return f"tensor-parallel worker rank {rank}"
    tp = config.tensor_parallel_size
    return f"worker rank {rank} (pipeline stage {rank // tp}, tensor-parallel rank {rank % tp})"


def rank_tag(config: EngineConfig, rank: int) -> str:
    """A rank's short name in its log lines: tp1, or pp1 tp0 under pipeline parallelism."""
    if config.pipeline_parallel_size == 1:
        return f"tp{rank}"
    tp = config.tensor_parallel_size
    return f"pp{rank // tp} tp{rank % tp}"


def rank_device(config: EngineConfig, local_rank: int, ranks_on_host: int):
    """A rank's torch device: cuda:local_rank, or the CPU with its share of the host's cores."""
    import torch

    device = torch.device(config.device)
    if device.type == "cuda" and (config.world_size > 1 or device.index is None):
        device = torch.device("cuda", local_rank)  # NOTE: config refuses cuda:N with several ranks
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # NOTE: the ranks share the host's cores; more threads each would only fight.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, ranks_on_host)))
    return device


def build_worker(config: EngineConfig, rank: int, local_rank: int, store: Any,
                 device) -> tuple[Any, dict[str, Any]]:
    """Join the group through `store` as `rank`, load the rank's shard and size its KV cache.

    Returns the Worker and what the driver needs to choose the common KV size: `num_blocks`,
    `device`, `weight_bytes`.
    """
    from peregrine.distributed import init_worker_group
    from peregrine.worker.worker import Worker

    # NOTE: NVLink multicast (NVLS) is off on the machines we target; NCCL fails to start when it
    # tries it there.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    init_worker_group(rank, config.world_size, store, device,
                      pipeline_parallel_size=config.pipeline_parallel_size,
                      peer_all_reduce=not config.disable_custom_all_reduce)
    worker = Worker(config, rank=rank, local_rank=local_rank, device=device)
    weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    return worker, {"num_blocks": worker.determine_num_blocks(), "device": str(device),
                    "weight_bytes": weight_bytes}


def choose_num_blocks(config: EngineConfig, sized: list[dict[str, Any]]) -> int:
    """Log each rank's room for KV blocks; return the number every rank allocates (the minimum)."""
    from peregrine.worker.kv_memory import common_num_blocks

    for rank, info in enumerate(sized):
        logger.info("%s on %s: weights %.2f GiB, room for %d KV blocks",
                    describe_rank(config, rank), info["device"], info["weight_bytes"] / 2**30,
                    info["num_blocks"])
    return common_num_blocks([info["num_blocks"] for info in sized])
