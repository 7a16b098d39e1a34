"""The KV cache's element type (--kv-cache-dtype) and what it costs per block."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from peregrine.kernels.reference import FP8_DTYPES

if TYPE_CHECKING:
    from peregrine.config import CacheConfig, ModelConfig

# Both backends store any of these (the kernels convert on store and on load). The FP8 caches hold
# k / k_scale and v / v_scale (per-layer scales, 1.0 unless the checkpoint gives them), saturated
# to the format's finite range.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the FP8 cache dtypes (these hold scaled values)."""
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for e4m3, 57344 for e5m2)."""
    if not is_fp8(dtype):
        raise ValueError(f"{dtype} is not an FP8 KV cache dtype "
                         f"({', '.join(map(str, FP8_DTYPES))})")
    return float(torch.finfo(dtype).max)


def check_kv_cache_dtype(name: str) -> None:
    """ValueError unless `name` is auto or a supported cache type."""
    if name == "auto" or name in KV_CACHE_DTYPES:
        return
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
