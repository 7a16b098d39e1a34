"""Sizing and allocating the paged KV cache pool."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from peregrine.attention.kv_dtype import kv_cache_bytes_per_block
from peregrine.config import EngineConfig, ModelConfig

logger = logging.getLogger("peregrine")
GiB = 1 << 30


def allocate_kv_caches(mc: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                       dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) pair per layer, each (num_blocks, block_size, Hkv, D), in `dtype`
    (default: the model's)."""
    shape = (num_blocks, block_size, mc.num_kv_heads, mc.head_dim)
    dt = dtype or mc.dtype
    return [(torch.zeros(shape, dtype=dt, device=device),
             torch.zeros(shape, dtype=dt, device=device)) for _ in range(mc.num_layers)]


def determine_num_blocks(config: EngineConfig, device: torch.device,
                         profile: Callable[[], None], reserve_bytes: int = 0) -> int:
    """Pool size: the override, else CPU memory budget, else profiled free GPU memory.

    profile: runs the worst-case step on `device` (with the model loaded and no KV cache yet).
    reserve_bytes: GPU memory allocated after the KV cache (CUDA graphs), left out of its budget.
    """
    cc, mc = config.cache, config.model
    per_block = kv_cache_bytes_per_block(cc, mc)
    if cc.num_gpu_blocks_override is not None:
        num_blocks = cc.num_gpu_blocks_override
    elif device.type != "cuda":
        num_blocks = int(cc.cpu_kv_cache_gb * GiB) // per_block
    else:
        num_blocks = _profile_gpu_blocks(device, config, per_block, profile, reserve_bytes)
    need = -(-mc.max_model_len // cc.block_size)
    tokens = num_blocks * cc.block_size
    logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %d tokens); max concurrency at "
                "max_model_len=%d: %.2fx", num_blocks, cc.block_size, num_blocks * per_block / GiB,
                tokens, mc.max_model_len, num_blocks / need)
    if num_blocks < 1:
        raise ValueError("no memory is left for the KV cache: lower max_num_batched_tokens or "
                         "raise gpu_memory_utilization / cpu_kv_cache_gb")
    if device.type == "cuda" and cc.num_gpu_blocks_override is None and num_blocks < need:
        raise ValueError(
            f"the KV cache holds {tokens} tokens but one request of max_model_len={mc.max_model_len} "
            f"needs {need * cc.block_size}: lower --max-model-len or raise --gpu-memory-utilization")
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
