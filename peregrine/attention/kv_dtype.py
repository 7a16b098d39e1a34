"""The KV cache's element type (--kv-cache-dtype) and what it costs per block."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from peregrine.config import CacheConfig, ModelConfig

# Both backends store any of these (the kernels convert on store and on load).
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


def check_kv_cache_dtype(name: str) -> None:
    """ValueError unless `name` is auto or a supported float type."""
    if name == "auto" or name in KV_CACHE_DTYPES:
        return
    if name in FP8_KV_CACHE_DTYPES:
        raise ValueError(f"invalid kv_cache_dtype: {name!r}: the FP8 KV cache is not available "
                         "in this version (use auto, float16, bfloat16 or float32)")
    raise ValueError(f"invalid kv_cache_dtype: {name!r} (expected auto, "
                     f"{', '.join(KV_CACHE_DTYPES)})")


def kv_cache_torch_dtype(cache_config: CacheConfig, model_config: ModelConfig) -> torch.dtype:
    """The dtype to allocate the K and V caches in: the model's for auto."""
    name = cache_config.cache_dtype
    check_kv_cache_dtype(name)
    return model_config.dtype if name == "auto" else KV_CACHE_DTYPES[name]


def kv_cache_bytes_per_block(cache_config: CacheConfig, model_config: ModelConfig) -> int:
    """K and V of every layer for one block of cache_config.block_size tokens (num_kv_heads as
    model_config gives them: pass a per-rank config under tensor parallelism)."""
    elem = torch.empty((), dtype=kv_cache_torch_dtype(cache_config, model_config)).element_size()
    mc = model_config
    return 2 * mc.num_layers * cache_config.block_size * mc.num_kv_heads * mc.head_dim * elem
