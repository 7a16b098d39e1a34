"""The physical KV block pool: ref counts, an LRU free queue, and the prefix-cache hash map."""
from __future__ import annotations

from collections.abc import Iterable

from peregrine.kv_cache.hashing import BlockHash


class KVBlock:
    """Bookkeeping for one physical block of the KV cache (the tensors live in the model runner)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set once the block is full and computed; kept after the block is freed so a later
        # request can still find it, cleared when the block is evicted (reused for new data).
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else ", cached"
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks in eviction order: the head is evicted first.

    A cached block that is hit while free is unlinked from the middle in O(1).
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        # Sentinels keep the link/unlink code free of head/tail special cases.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def append(self, block: KVBlock) -> None:
        """Link `block` at the tail (evicted last)."""
        assert block.prev_free is None and block.next_free is None, f"{block} already queued"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        """Unlink `block` from wherever it is in the queue."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        """Unlink and return the head (the least recently freed block)."""
        first = self._head.next_free
        assert first is not None and first is not self._tail, "free queue is empty"
        self.remove(first)
        return first

    def block_ids(self) -> list[int]:
        """Free block ids, head first (for tests and debugging)."""
        out: list[int] = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node.block_id)
            node = node.next_free
        return out


class BlockPool:
    """Blocks 0..num_blocks-1 with ref counts; free blocks stay findable by hash until evicted."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached or not): what an allocation may take."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num: int) -> list[KVBlock]:
        """Take `num` free blocks (evicting their cached contents), each with ref count 1."""
        if num > self.num_free_blocks:
            raise ValueError(f"cannot take {num} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(num):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block holding the computed KV of `block_hash`, if it is still cached."""
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue in this order."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Make a full, computed block findable by `block_hash`; False if another block has it."""
        assert self.enable_caching and block.ref_cnt > 0
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached:
            # NOTE: two requests computed the same content in the same step (neither could hit
            # the other); the first block stays the canonical copy, this one is freed normally.
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their data); returns how many dropped."""
        dropped = len(self.cached)
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return dropped

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None


class CpuBlockPool:
    """Block ids 0..num_blocks-1 of the CPU swap space: no ref counts, no hashes.

    Never-used ids are handed out in order before freed ones are reused, so a swap-out's blocks
    tend to be contiguous (the copy then moves few runs); nothing is allocated up front.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._next_unused = 0
        self._free: list[int] = []  # freed ids, reused last-in first-out

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._next_unused + len(self._free)

    def allocate(self, num: int) -> list[int]:
        """Take `num` block ids."""
        if num > self.num_free_blocks:
            raise ValueError(f"cannot take {num} CPU blocks, only {self.num_free_blocks} free")
        take = min(num, len(self._free))
        out = self._free[len(self._free) - take:][::-1]
        del self._free[len(self._free) - take:]
        if take < num:
            start = self._next_unused
            self._next_unused += num - take
            out.extend(range(start, self._next_unused))
        return out

    def free(self, block_ids: list[int]) -> None:
        """Return block ids; the first of them is reused first."""
        self._free.extend(reversed(block_ids))
