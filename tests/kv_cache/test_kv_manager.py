"""KVCacheManager: exact block ids, eviction order, prefix hits in tokens, forks."""
from __future__ import annotations

import pytest

from peregrine.engine.request import Request
from peregrine.kv_cache.manager import KVCacheManager
from peregrine.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int], **sp) -> Request:
    return Request(rid, list(tokens), SamplingParams(**sp), arrival_time=0.0, max_tokens=16)


def _admit(mgr: KVCacheManager, req: Request) -> int:
    """Look up the prefix, allocate the rest, mark the whole prompt computed; returns hit tokens."""
    computed = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - computed.num_tokens, computed)
    req.num_computed_tokens = req.num_tokens
    mgr.cache_computed_blocks(req)
    return computed.num_tokens


def test_allocate_assigns_lowest_free_ids():
    mgr = KVCacheManager(8, 16, enable_caching=True)
    req = _req("a", range(40))
    assert mgr.allocate_slots(req, 40)
    assert req.block_ids == [0, 1, 2]
    assert mgr.usage == pytest.approx(3 / 8)


def test_allocate_failure_changes_nothing():
    mgr = KVCacheManager(2, 4, enable_caching=True)
    req = _req("a", range(12))
    assert not mgr.allocate_slots(req, 12)
    assert req.block_ids == [] and mgr.num_free_blocks == 2


def test_growing_sequence_appends_block_ids():
    mgr = KVCacheManager(4, 4, enable_caching=False)
    req = _req("a", range(4))
    assert mgr.allocate_slots(req, 4)
    req.num_computed_tokens = 4
    req.append_output_token(99)
    assert mgr.allocate_slots(req, 1)
    assert req.block_ids == [0, 1]
    req.num_computed_tokens = 5
    req.append_output_token(98)
    assert mgr.allocate_slots(req, 1)
    assert req.block_ids == [0, 1]


def test_prefix_hit_counts_in_tokens():
    mgr = KVCacheManager(16, 16, enable_caching=True)
    assert _admit(mgr, _req("a", range(40))) == 0
    assert _admit(mgr, _req("b", range(40))) == 32
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (80, 32)


def test_last_prompt_token_always_recomputed():
    mgr = KVCacheManager(16, 16, enable_caching=True)
    _admit(mgr, _req("a", range(32)))
    b = _req("b", range(32))
    computed = mgr.get_computed_blocks(b)
    assert computed.num_tokens == 16
    assert [blk.block_id for blk in computed.blocks] == [0]


def test_partial_prefix_hits_up_to_first_difference():
    mgr = KVCacheManager(16, 4, enable_caching=True)
    _admit(mgr, _req("a", range(12)))
    tokens = [0, 1, 2, 3, 4, 5, 6, 7, 100, 101, 102, 103, 104]
    assert _admit(mgr, _req("b", tokens)) == 8


def test_hit_shares_blocks_by_ref_count():
    mgr = KVCacheManager(8, 4, enable_caching=True)
    a, b = _req("a", range(9)), _req("b", range(9))
    _admit(mgr, a)
    _admit(mgr, b)
    assert a.block_ids == [0, 1, 2]
    assert b.block_ids == [0, 1, 3]
    assert [mgr.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]


def test_exact_eviction_order():
    mgr = KVCacheManager(6, 4, enable_caching=True)
    a = _req("a", range(12))
    _admit(mgr, a)
    assert a.block_ids == [0, 1, 2]
    mgr.free(a)
    # Never-used blocks first, then a's blocks tail first: its prefix block is evicted last.
    assert mgr.pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    b = _req("b", range(100, 108))
    _admit(mgr, b)
    assert b.block_ids == [3, 4]
    c = _req("c", range(200, 212))
    _admit(mgr, c)
    assert c.block_ids == [5, 2, 1]
    mgr.free(b)
    mgr.free(c)
    assert mgr.pool.free_queue.block_ids() == [0, 4, 3, 1, 2, 5]
    d = _req("d", range(12))
    assert _admit(mgr, d) == 4  # only a's first block survived
    assert d.block_ids == [0, 4, 3]


def test_generated_tokens_are_cached():
    mgr = KVCacheManager(8, 4, enable_caching=True)
    a = _req("a", range(6))
    _admit(mgr, a)
    for tok in (6, 7, 8):
        a.append_output_token(tok)
        assert mgr.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        mgr.cache_computed_blocks(a)
    mgr.free(a)
    assert _admit(mgr, _req("b", range(10))) == 8


def test_revived_cached_blocks_count_against_free_blocks():
    mgr = KVCacheManager(4, 4, enable_caching=True)
    a = _req("a", range(9))
    _admit(mgr, a)
    mgr.free(a)
    b = _req("b", list(range(8)) + list(range(50, 62)))  # 20 tokens: 5 blocks > 4
    computed = mgr.get_computed_blocks(b)
    assert computed.num_tokens == 8
    assert not mgr.allocate_slots(b, 12, computed)
    assert b.block_ids == [] and mgr.num_free_blocks == 4
    assert all(blk.ref_cnt == 0 for blk in mgr.pool.blocks)
    assert mgr.prefix_cache_queries == 9  # a failed admission is not counted


def test_cache_salt_prevents_sharing():
    mgr = KVCacheManager(8, 4, enable_caching=True)
    _admit(mgr, _req("a", range(9)))
    b = Request("b", list(range(9)), SamplingParams(), arrival_time=0.0, max_tokens=4,
                cache_salt="other")
    assert _admit(mgr, b) == 0


def test_same_salt_shares_and_other_salts_get_their_own_blocks():
    mgr = KVCacheManager(16, 4, enable_caching=True)
    a = _req("a", range(9), cache_salt="tenant-a")
    assert _admit(mgr, a) == 0
    b = _req("b", range(9), cache_salt="tenant-a")
    assert _admit(mgr, b) == 8 and b.block_ids[:2] == a.block_ids[:2]
    c = _req("c", range(9), cache_salt="tenant-c")
    assert _admit(mgr, c) == 0 and not set(c.block_ids) & set(a.block_ids)
    d = _req("d", range(9))  # no salt: shares with neither
    assert _admit(mgr, d) == 0 and not set(d.block_ids) & set(a.block_ids + c.block_ids)
    assert _admit(mgr, _req("e", range(9))) == 8  # but with other unsalted requests


def test_salt_changes_the_first_block_hash_and_so_every_later_one():
    a, b = _req("a", range(12)), _req("b", range(12), cache_salt="s")
    mgr = KVCacheManager(16, 4, enable_caching=True)
    _admit(mgr, a)
    _admit(mgr, b)
    assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes))
    assert len(a.block_hashes) == len(b.block_hashes) == 3


def test_prompt_logprobs_skip_lookup_but_populate_cache():
    mgr = KVCacheManager(8, 4, enable_caching=True)
    _admit(mgr, _req("a", range(9)))
    b = _req("b", range(9), prompt_logprobs=1)
    assert _admit(mgr, b) == 0
    mgr.free(b)
    mgr.reset_prefix_cache()
    _admit(mgr, _req("c", range(9), prompt_logprobs=0))
    assert _admit(mgr, _req("d", range(9))) == 8
    assert mgr.prefix_cache_queries == 9 + 9  # the prompt_logprobs requests queried nothing


def test_caching_disabled_never_hashes_or_hits():
    mgr = KVCacheManager(8, 4, enable_caching=False)
    a, b = _req("a", range(9)), _req("b", range(9))
    _admit(mgr, a)
    assert _admit(mgr, b) == 0
    assert a.block_hashes == [] and mgr.pool.cached == {}
    assert b.block_ids == [3, 4, 5]


@pytest.mark.parametrize("caching", [True, False])
def test_fork_shares_full_blocks(caching):
    mgr = KVCacheManager(8, 4, enable_caching=caching)
    src, dst = _req("src", range(10)), _req("dst", range(10))
    _admit(mgr, src)
    assert mgr.fork(src, dst, 9) == 8
    dst.num_computed_tokens = 8
    assert mgr.allocate_slots(dst, 2)
    assert src.block_ids == [0, 1, 2] and dst.block_ids == [0, 1, 3]
    mgr.free(src)
    assert [mgr.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]


def test_free_is_idempotent_and_releases_everything():
    mgr = KVCacheManager(4, 4, enable_caching=True)
    a = _req("a", range(9))
    _admit(mgr, a)
    mgr.free(a)
    mgr.free(a)
    assert a.block_ids == [] and mgr.num_free_blocks == 4 and mgr.usage == 0.0


def test_reset_prefix_cache_stops_hits():
    mgr = KVCacheManager(8, 4, enable_caching=True)
    a = _req("a", range(9))
    _admit(mgr, a)
    mgr.free(a)
    assert mgr.reset_prefix_cache() == 2
    assert _admit(mgr, _req("b", range(9))) == 0


# ---- swapping to the CPU pool -------------------------------------------------------------------

def test_cpu_pool_hands_out_unused_ids_in_order_then_reuses_freed_ones():
    from peregrine.kv_cache.block_pool import CpuBlockPool
    pool = CpuBlockPool(6)
    assert pool.allocate(3) == [0, 1, 2] and pool.num_free_blocks == 3
    pool.free([1, 2])
    assert pool.allocate(3) == [1, 2, 3]
    with pytest.raises(ValueError, match="cannot take 3 CPU blocks, only 2 free"):
        pool.allocate(3)


def test_swap_out_and_in_move_exactly_the_kept_blocks():
    mgr = KVCacheManager(6, 4, enable_caching=False, num_cpu_blocks=4)
    req = _req("a", range(10))
    _admit(mgr, req)
    assert req.block_ids == [0, 1, 2]
    copies = mgr.swap_out(req, 9)  # blocks 0..2 hold tokens 0..8
    assert copies == [(0, 0), (1, 1), (2, 2)]
    assert req.block_ids == [] and mgr.num_free_blocks == 6 and mgr.num_free_cpu_blocks == 1
    other = _req("b", range(100, 104))
    _admit(mgr, other)  # takes device block 0 (any free block may be reused now)
    req.num_computed_tokens = 9
    back = mgr.swap_in(req, 1)
    assert [cpu for cpu, _ in back] == [0, 1, 2]
    assert req.block_ids == [dev for _, dev in back] and 0 not in req.block_ids
    assert mgr.num_free_cpu_blocks == 4 and not mgr.is_swapped(req)


def test_swap_out_frees_blocks_past_the_kept_tokens():
    mgr = KVCacheManager(6, 4, enable_caching=False, num_cpu_blocks=4)
    req = _req("a", range(12))
    _admit(mgr, req)
    assert mgr.swap_out(req, 4) == [(0, 0)]
    assert mgr.num_free_blocks == 6 and mgr.num_free_cpu_blocks == 3


def test_swap_out_without_cpu_room_changes_nothing():
    mgr = KVCacheManager(6, 4, enable_caching=False, num_cpu_blocks=2)
    req = _req("a", range(12))
    _admit(mgr, req)
    assert mgr.swap_out(req, 12) is None
    assert req.block_ids == [0, 1, 2] and mgr.num_free_blocks == 3
    assert mgr.num_free_cpu_blocks == 2 and not mgr.is_swapped(req)


def test_swap_in_without_device_room_changes_nothing():
    mgr = KVCacheManager(3, 4, enable_caching=False, num_cpu_blocks=4)
    req = _req("a", range(8))
    _admit(mgr, req)
    mgr.swap_out(req, 8)
    hog = _req("b", range(100, 108))
    _admit(mgr, hog)
    req.num_computed_tokens = 8
    assert mgr.swap_in(req, 1) is None  # needs 2 + 1 blocks, 1 is free
    assert mgr.is_swapped(req) and mgr.num_free_blocks == 1 and mgr.num_free_cpu_blocks == 2
    mgr.free(req)
    assert mgr.num_free_cpu_blocks == 4 and not mgr.is_swapped(req)


def test_swap_keeps_full_shared_blocks_but_copies_a_partly_kept_one():
    mgr = KVCacheManager(8, 4, enable_caching=True, num_cpu_blocks=8)
    a = _req("a", range(12))
    _admit(mgr, a)
    b = _req("b", list(range(12)) + [50])
    assert _admit(mgr, b) == 12  # shares a's three blocks
    assert mgr.swap_out_size(b, 13) == (1, 12)
    assert mgr.swap_out_size(b, 6) == (1, 4)  # block 1 would be written again: copied
    copies = mgr.swap_out(b, 6)
    assert copies == [(1, 0)]
    assert [blk.ref_cnt for blk in mgr.pool.blocks[:3]] == [2, 1, 1]
    assert mgr.swapped_device_blocks(b) == 1
