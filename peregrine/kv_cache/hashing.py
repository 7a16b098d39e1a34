"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal whole
prefixes, not just equal blocks. The first block's hash also covers an extra key (the request's
cache_salt; later adapter ids), which the chain carries into every later block: requests whose
extra keys differ share no block.

NOTE: we use SHA-256 rather than Python's `hash()`. A 64-bit, non-cryptographic hash lets a client
craft a prompt whose block hash collides with another tenant's prefix, then read or poison that KV;
SHA-256 makes that infeasible. It costs ~1-2 us per block and runs once per full block. Token ids
are packed as int64 (not pickled), so `int`, numpy and other integer types hash identically.
"""
from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peregrine.engine.request import Request

BlockHash = bytes  # 32-byte SHA-256 digest

_NO_EXTRA = b"\x00"


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_key: tuple[Any, ...] | None = None) -> BlockHash:
    """Hash one full block given its parent block's hash (None for the first block)."""
    h = hashlib.sha256()
    h.update(parent_hash if parent_hash is not None else b"root")
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(array("q", token_ids).tobytes())
    h.update(_NO_EXTRA if extra_key is None else pickle.dumps(extra_key, protocol=4))
    return h.digest()


def request_extra_key(req: Request) -> tuple[Any, ...] | None:
    """What besides token ids must match for two requests to share KV blocks."""
    if req.cache_salt is None:
        return None
    return ("salt", req.cache_salt)


def update_block_hashes(req: Request, block_size: int) -> int:
    """Extend `req.block_hashes` over every full block of `req.all_token_ids`; returns the count."""
    hashes = req.block_hashes
    num_full = req.num_tokens // block_size
    if len(hashes) >= num_full:
        return len(hashes)
    tokens = req.all_token_ids
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        # NOTE: the extra key enters the first block only; the chain carries it onwards.
        extra = request_extra_key(req) if i == 0 else None
        parent = hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size], extra)
        hashes.append(parent)
    return num_full
