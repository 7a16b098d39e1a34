"""What every multi-worker executor does for one rank, wherever the rank runs (a spawned process, a
Ray actor): choose its device, join the workers' process group, build the Worker and size its KV
cache; and what the driver does with the sizes (one log line per rank, the minimum over ranks)."""
from __future__ import annotations

import logging
import os
from typing import Any

from peregrine.config import EngineConfig

logger = logging.getLogger("peregrine")


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
    init_worker_group(rank, config.world_size, store, device)
    worker = Worker(config, rank=rank, local_rank=local_rank, device=device)
    weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    return worker, {"num_blocks": worker.determine_num_blocks(), "device": str(device),
                    "weight_bytes": weight_bytes}


def choose_num_blocks(sized: list[dict[str, Any]]) -> int:
    """Log each rank's room for KV blocks; return the number every rank allocates (the minimum)."""
    from peregrine.worker.kv_memory import common_num_blocks

    for rank, info in enumerate(sized):
        logger.info("tensor-parallel rank %d on %s: weights %.2f GiB, room for %d KV blocks",
                    rank, info["device"], info["weight_bytes"] / 2**30, info["num_blocks"])
    return common_num_blocks([info["num_blocks"] for info in sized])
