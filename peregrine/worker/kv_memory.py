"""Sizing and allocating the paged KV cache pool."""
from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import os
from collections.abc import Callable

import torch

from peregrine.attention.kv_dtype import kv_cache_bytes_per_block
from peregrine.config import EngineConfig, ModelConfig

logger = logging.getLogger("peregrine")
GiB = 1 << 30
# The default CPU KV pool takes at most this share of the memory available when it is sized.
CPU_KV_MEMORY_FRACTION = 0.25


def allocate_kv_caches(mc: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                       dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) pair per layer, each (num_blocks, block_size, Hkv, D), in `dtype`
    (default: the model's)."""
    shape = (num_blocks, block_size, mc.num_kv_heads, mc.head_dim)
    dt = dtype or mc.dtype
    if device.type == "cpu":
        return [(_untouched_zeros(shape, dt), _untouched_zeros(shape, dt))
                for _ in range(mc.num_layers)]
    return [(torch.zeros(shape, dtype=dt, device=device),
             torch.zeros(shape, dtype=dt, device=device)) for _ in range(mc.num_layers)]


def _untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous memory mapping.

    NOTE: the OS maps a page of the mapping on its first write, so KV blocks no request has used
    yet cost no resident memory (torch.zeros would write every page up front).
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)  # the tensor keeps the mapping alive
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def available_memory_bytes() -> int:
    """Memory the OS can still give this process: MemAvailable, or the cgroup's remaining limit
    when lower; the physical memory where /proc is missing."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    if not found:
        found.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return min(found)


def full_batch_blocks(config: EngineConfig) -> int:
    """Blocks that max_num_seqs sequences of max_model_len tokens hold at once."""
    cc, sc = config.cache, config.scheduler
    return -(-sc.max_model_len // cc.block_size) * sc.max_num_seqs


def gpu_blocks_cap(config: EngineConfig) -> int:
    """The most blocks a GPU pool sized from memory takes: a full batch (full_batch_blocks) plus
    one block per sequence.

    NOTE: blocks past these can only keep more finished prefixes cached, so a small model does
    not take the whole GPU (allocated, zeroed and freed again on every start). The margin is room
    for a step that holds slots for tokens past a full-length sequence's last one (speculative
    tokens); cached prefixes live in whatever the running sequences leave free.
    """
    return full_batch_blocks(config) + config.scheduler.max_num_seqs


def cpu_num_blocks(config: EngineConfig, per_block: int, available: int | None = None) -> int:
    """The CPU pool: cpu_kv_cache_gb when given; else blocks for max_num_seqs sequences of
    max_model_len tokens, capped at CPU_KV_MEMORY_FRACTION of `available` bytes (default: the
    memory available now) but never below one full-length sequence."""
    cc, sc = config.cache, config.scheduler
    if cc.cpu_kv_cache_gb is not None:
        return int(cc.cpu_kv_cache_gb * GiB) // per_block
    per_seq = -(-sc.max_model_len // cc.block_size)
    wanted = full_batch_blocks(config)
    avail = available_memory_bytes() if available is None else available
    cap = int(avail * CPU_KV_MEMORY_FRACTION) // per_block
    return min(wanted, max(per_seq, cap))


def rank_model_config(config: EngineConfig, num_layers: int | None = None) -> ModelConfig:
    """The model as one rank's KV cache sees it: num_kv_heads / tensor_parallel_size heads and
    its pipeline stage's `num_layers` layers (default: all)."""
    mc = config.model
    return dataclasses.replace(
        mc, num_kv_heads=mc.num_kv_heads // config.tensor_parallel_size,
        num_layers=mc.num_layers if num_layers is None else num_layers)


def determine_num_blocks(config: EngineConfig, device: torch.device,
                         profile: Callable[[], None], reserve_bytes: int = 0,
                         model_config: ModelConfig | None = None,
                         extra_bytes_per_block: int = 0) -> int:
    """Pool size: the override, else the CPU sizing (cpu_num_blocks), else profiled free GPU
    memory, capped at gpu_blocks_cap.

    profile: runs the worst-case step on `device` (with the model loaded and no KV cache yet).
    reserve_bytes: GPU memory allocated after the KV cache (CUDA graphs), left out of its budget.
    model_config: this rank's share of the model (rank_model_config; default: all of it).
    extra_bytes_per_block: what else each block costs (a draft model's KV cache).
    """
    cc, mc = config.cache, model_config or config.model
    per_block = kv_cache_bytes_per_block(cc, mc) + extra_bytes_per_block
    if cc.num_gpu_blocks_override is not None:
        num_blocks = cc.num_gpu_blocks_override
    elif device.type != "cuda":
        num_blocks = cpu_num_blocks(config, per_block)
    else:
        num_blocks = capped_gpu_blocks(
            config, _profile_gpu_blocks(device, config, per_block, profile, reserve_bytes))
    need = -(-mc.max_model_len // cc.block_size)
    tokens = num_blocks * cc.block_size
    logger.info("KV cache: %d blocks of %d tokens (%.2f GiB%s, %d tokens); max concurrency at "
                "max_model_len=%d: %.2fx", num_blocks, cc.block_size, num_blocks * per_block / GiB,
                "" if device.type == "cuda" else ", taken as blocks are first written", tokens,
                mc.max_model_len, num_blocks / need)
    if num_blocks < 1:
        raise ValueError("no memory is left for the KV cache: lower max_num_batched_tokens or "
                         "raise gpu_memory_utilization (CUDA) / cpu_kv_cache_gb (CPU)")
    if device.type == "cuda" and cc.num_gpu_blocks_override is None and num_blocks < need:
        raise ValueError(
            f"the KV cache holds {tokens} tokens but one request of max_model_len={mc.max_model_len} "
            f"needs {need * cc.block_size}: lower --max-model-len or raise --gpu-memory-utilization")
    return num_blocks


def capped_gpu_blocks(config: EngineConfig, room: int) -> int:
    """`room` blocks fit in the memory budget; the pool takes at most gpu_blocks_cap of them."""
    cap = gpu_blocks_cap(config)
    if room <= cap:
        return room
    sc = config.scheduler
    logger.info("KV cache capped at %d blocks (max_num_seqs %d x max_model_len %d, + one block per "
                "sequence); memory had room for %d (num_gpu_blocks_override sets the size)",
                cap, sc.max_num_seqs, sc.max_model_len, room)
    return cap


def common_num_blocks(per_rank: list[int]) -> int:
    """The pool every rank allocates: the smallest any rank has room for."""
    if not per_rank:
        raise ValueError("no ranks to size the KV cache for")
    num_blocks = min(per_rank)
    if len(per_rank) > 1:
        logger.info("KV cache: %d blocks on each of %d ranks (the smallest room of any rank; "
                    "rooms %s)", num_blocks, len(per_rank), per_rank)
    return num_blocks


@torch.inference_mode()
def _profile_gpu_blocks(dev: torch.device, config: EngineConfig, per_block: int,
                        profile: Callable[[], None], reserve: int = 0) -> int:
    """(total x utilization - weights - peak activations - non-torch memory - reserve) / bytes
    per block."""
    torch.cuda.synchronize(dev)
    weights = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    profile()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    free, total = torch.cuda.mem_get_info(dev)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(dev))
    budget = total * config.cache.gpu_memory_utilization - peak - non_torch - reserve
    logger.info("GPU memory: total %.2f GiB, weights %.2f GiB, peak activations %.2f GiB, "
                "non-torch %.2f GiB, CUDA graphs (reserved) %.2f GiB, KV budget %.2f GiB",
                total / GiB, weights / GiB, (peak - weights) / GiB, non_torch / GiB,
                reserve / GiB, max(budget, 0) / GiB)
    torch.cuda.empty_cache()
    return max(0, int(budget) // per_block)
