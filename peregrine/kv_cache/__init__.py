"""Paged KV block management: block pool (ref counts, LRU free queue), prefix hashing, manager."""
from __future__ import annotations

from peregrine.kv_cache.block_pool import BlockPool, CpuBlockPool, FreeBlockQueue, KVBlock
from peregrine.kv_cache.hashing import BlockHash, hash_block_tokens, update_block_hashes
from peregrine.kv_cache.manager import NO_COMPUTED_BLOCKS, ComputedBlocks, KVCacheManager

__all__ = ["BlockPool", "CpuBlockPool", "FreeBlockQueue", "KVBlock", "BlockHash", "hash_block_tokens",
           "update_block_hashes", "ComputedBlocks", "NO_COMPUTED_BLOCKS", "KVCacheManager"]
