"""BlockPool and its LRU free queue: exact ids, ref counts and hash-map bookkeeping."""
from __future__ import annotations

import pytest

from peregrine.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVBlock
from peregrine.kv_cache.hashing import hash_block_tokens


def _h(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def test_free_queue_starts_in_id_order():
    q = FreeBlockQueue([KVBlock(i) for i in range(4)])
    assert q.block_ids() == [0, 1, 2, 3]
    assert len(q) == 4


def test_free_queue_remove_from_middle_keeps_order():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4]
    assert len(q) == 4
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert q.block_ids() == [1, 3, 4, 2]


def test_get_new_blocks_takes_lowest_ids_with_ref_one():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)


def test_get_new_blocks_beyond_free_raises():
    pool = BlockPool(2, enable_caching=True)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)


def test_freed_blocks_join_queue_in_given_order():
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([c, a, b])
    assert pool.free_queue.block_ids() == [3, 2, 0, 1]


def test_shared_block_is_freed_only_at_ref_zero():
    pool = BlockPool(2, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.touch([a])
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([a])
    assert a.ref_cnt == 0 and pool.num_free_blocks == 2


def test_freed_cached_block_stays_findable_until_reused():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, _h(1))
    pool.free_blocks([a])
    assert pool.get_cached_block(_h(1)) is a
    (reused,) = pool.get_new_blocks(1)
    assert reused is a
    assert pool.get_cached_block(_h(1)) is None
    assert a.block_hash is None


def test_touch_revives_free_cached_block():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_block(blocks[1], _h(7))
    pool.free_blocks(blocks)
    pool.touch([pool.get_cached_block(_h(7))])
    assert pool.free_queue.block_ids() == [0, 2]
    assert blocks[1].ref_cnt == 1


def test_duplicate_content_keeps_first_block_canonical():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, _h(3)) is True
    assert pool.cache_full_block(b, _h(3)) is False
    assert pool.get_cached_block(_h(3)) is a
    assert b.block_hash is None


def test_reset_prefix_cache_forgets_all_hashes():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, _h(1))
    pool.cache_full_block(b, _h(2))
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() == 2
    assert pool.cached == {}
    assert a.block_hash is None and b.block_hash is None


def test_zero_blocks_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, enable_caching=True)
