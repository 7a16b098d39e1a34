"""Chained block hashes: what changes them and what does not."""
from __future__ import annotations

from peregrine.engine.request import Request
from peregrine.kv_cache.hashing import hash_block_tokens, update_block_hashes
from peregrine.sampling_params import SamplingParams


def _req(tokens: list[int], salt: str | None = None) -> Request:
    return Request("r", tokens, SamplingParams(), arrival_time=0.0, max_tokens=16, cache_salt=salt)


def test_hash_is_deterministic_32_bytes():
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert h == hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == 32


def test_parent_changes_hash():
    parent = hash_block_tokens(None, [9, 9])
    assert hash_block_tokens(parent, [1, 2]) != hash_block_tokens(None, [1, 2])


def test_extra_key_changes_hash():
    assert hash_block_tokens(None, [1, 2], ("salt", "a")) != hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2], ("salt", "a")) != hash_block_tokens(None, [1, 2], ("salt", "b"))


def test_integer_type_does_not_change_hash():
    class MyInt(int):
        pass
    assert hash_block_tokens(None, [MyInt(5), MyInt(6)]) == hash_block_tokens(None, (5, 6))


def test_update_hashes_only_full_blocks_incrementally():
    req = _req(list(range(10)))
    assert update_block_hashes(req, 4) == 2
    first = list(req.block_hashes)
    req.append_output_token(10)
    req.append_output_token(11)
    assert update_block_hashes(req, 4) == 3
    assert req.block_hashes[:2] == first
    assert req.block_hashes[2] == hash_block_tokens(first[1], [8, 9, 10, 11])


def test_equal_block_after_different_prefix_hashes_differently():
    a = _req([1, 2, 3, 4, 5, 6, 7, 8])
    b = _req([0, 2, 3, 4, 5, 6, 7, 8])
    update_block_hashes(a, 4)
    update_block_hashes(b, 4)
    assert a.block_hashes[1] != b.block_hashes[1]


def test_cache_salt_separates_requests():
    a, b = _req([1, 2, 3, 4]), _req([1, 2, 3, 4], salt="tenant-b")
    update_block_hashes(a, 4)
    update_block_hashes(b, 4)
    assert a.block_hashes != b.block_hashes


def test_salt_enters_the_first_block_and_the_chain_carries_it():
    plain, salted = _req(list(range(8))), _req(list(range(8)), salt="t")
    update_block_hashes(plain, 4)
    update_block_hashes(salted, 4)
    assert salted.block_hashes[0] == hash_block_tokens(None, [0, 1, 2, 3], ("salt", "t"))
    assert salted.block_hashes[1] == hash_block_tokens(salted.block_hashes[0], [4, 5, 6, 7])
    assert plain.block_hashes[1] != salted.block_hashes[1]


def test_salt_comes_from_the_sampling_params():
    req = Request("r", [1, 2, 3, 4], SamplingParams(cache_salt="t"), arrival_time=0.0,
                  max_tokens=4)
    update_block_hashes(req, 4)
    assert req.cache_salt == "t" and req.block_hashes == [_salted([1, 2, 3, 4], "t")]


def _salted(tokens: list[int], salt: str) -> bytes:
    return hash_block_tokens(None, tokens, ("salt", salt))
