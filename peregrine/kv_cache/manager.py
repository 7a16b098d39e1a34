"""Per-request block tables on top of the block pool, with automatic prefix caching."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from peregrine.kv_cache.block_pool import BlockPool, CpuBlockPool, KVBlock
from peregrine.kv_cache.hashing import update_block_hashes

if TYPE_CHECKING:
    from peregrine.engine.request import Request


class ComputedBlocks(NamedTuple):
    """A prefix-cache lookup result, handed to `allocate_slots` at admission."""

    blocks: list[KVBlock]  # cached blocks holding the request's first `num_tokens` tokens
    num_tokens: int  # len(blocks) * block_size
    num_queried_tokens: int  # tokens that were looked up (0 when the lookup was skipped)


NO_COMPUTED_BLOCKS = ComputedBlocks([], 0, 0)


class KVCacheManager:
    """Owns `req.block_ids`: allocates, shares (prefix hits, forks) and frees blocks by ref count.

    Growing a sequence only appends block ids; blocks are never copied or moved, except when a
    preempted request is swapped out to the CPU pool (`swap_out`) and back (`swap_in`).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 num_cpu_blocks: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)
        # Swapped-out request id -> its block table: a KVBlock still held on the device (shared
        # with other requests), or an int, the CPU block holding that block's KV.
        self._swapped: dict[str, list[KVBlock | int]] = {}
        self._blocks: dict[str, list[KVBlock]] = {}  # request id -> its blocks, in order
        self._num_cached: dict[str, int] = {}  # request id -> leading blocks already hashed/cached
        self.prefix_cache_queries = 0  # cumulative prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # cumulative tokens found in the cache at admission

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, in [0, 1] (free cached blocks count as free)."""
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, req: Request) -> ComputedBlocks:
        """The longest cached prefix of `req`'s full blocks; no side effects."""
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            # NOTE: prompt logprobs need the logits of every prompt position, so nothing is skipped.
            return NO_COMPUTED_BLOCKS
        update_block_hashes(req, self.block_size)
        # NOTE: the last known token is always recomputed so that its logits exist; a prompt of
        # exactly k full blocks can therefore hit at most k - 1 of them.
        max_blocks = (req.num_tokens - 1) // self.block_size
        blocks: list[KVBlock] = []
        for block_hash in req.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return ComputedBlocks(blocks, len(blocks) * self.block_size, req.num_tokens)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: ComputedBlocks | None = None) -> bool:
        """Hold blocks for req's computed tokens + `computed_blocks` + `num_new_tokens` more.

        Returns False, changing nothing, when the pool lacks free blocks. `computed_blocks` may only
        be given at admission (request holds no blocks and has num_computed_tokens == 0).
        """
        held = self._blocks.get(req.request_id)
        if (computed_blocks is None and held and
                req.num_computed_tokens + num_new_tokens <= len(held) * self.block_size):
            return True  # NOTE: the common decode: its held blocks have room, nothing changes
        computed = computed_blocks.blocks if computed_blocks is not None else []
        num_computed = req.num_computed_tokens
        if computed_blocks is not None:
            assert not held and num_computed == 0, f"{req} is not being admitted"
            num_computed = computed_blocks.num_tokens
        num_held = len(held) if held else 0
        num_new_blocks = max(
            0, self.num_blocks_for(num_computed + num_new_tokens) - num_held - len(computed))
        # Cached blocks nobody references sit in the free queue: touching them uses free blocks.
        num_revived = sum(1 for block in computed if block.ref_cnt == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return False
        if held is None:
            held = self._blocks[req.request_id] = []
            self._num_cached[req.request_id] = 0
        if computed:
            self.pool.touch(computed)
            held.extend(computed)
            req.block_ids.extend(block.block_id for block in computed)
            self._num_cached[req.request_id] = len(computed)
        if num_new_blocks:
            new = self.pool.get_new_blocks(num_new_blocks)
            held.extend(new)
            req.block_ids.extend(block.block_id for block in new)
        if computed_blocks is not None:
            self.prefix_cache_queries += computed_blocks.num_queried_tokens
            self.prefix_cache_hits += computed_blocks.num_tokens
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Make req's full blocks whose KV is computed (num_computed_tokens) findable by hash."""
        if not self.enable_caching:
            return
        start = self._num_cached.get(req.request_id)
        # NOTE: most steps fill no new block (a decode adds one token); checked before any work.
        if start is None or req.num_computed_tokens < (start + 1) * self.block_size:
            return
        held = self._blocks[req.request_id]
        # NOTE: with async scheduling num_computed_tokens may run ahead of the known token ids.
        num_full = min(min(req.num_computed_tokens, req.num_tokens) // self.block_size, len(held))
        if num_full <= start:
            return
        update_block_hashes(req, self.block_size)
        for i in range(start, num_full):
            self.pool.cache_full_block(held[i], req.block_hashes[i])
        self._num_cached[req.request_id] = num_full

    def fork(self, src_req: Request, dst_req: Request, num_tokens: int) -> int:
        """Let dst_req share src_req's first `num_tokens // block_size` full, computed blocks.

        dst_req must hold no blocks and have the same leading tokens. Returns the shared tokens;
        the caller sets dst_req.num_computed_tokens and then allocates the rest with allocate_slots.
        """
        num_shared = num_tokens // self.block_size
        src_blocks = self._blocks.get(src_req.request_id, [])
        assert dst_req.request_id not in self._blocks and not dst_req.block_ids, \
            f"{dst_req} already holds blocks"
        assert num_shared * self.block_size <= src_req.num_computed_tokens
        assert num_shared <= len(src_blocks)
        end = num_shared * self.block_size
        assert dst_req.all_token_ids[:end] == src_req.all_token_ids[:end], "fork of other tokens"
        shared = src_blocks[:num_shared]
        self.pool.touch(shared)
        self._blocks[dst_req.request_id] = list(shared)
        self._num_cached[dst_req.request_id] = min(
            self._num_cached.get(src_req.request_id, 0), num_shared)
        dst_req.block_ids.extend(block.block_id for block in shared)
        return end

    # ---- swapping to the CPU pool -----------------------------------------------------------

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free_blocks

    @property
    def num_swapped_requests(self) -> int:
        return len(self._swapped)

    def is_swapped(self, req: Request) -> bool:
        return req.request_id in self._swapped

    def swapped_device_blocks(self, req: Request) -> int:
        """Device blocks a swapped request still holds (shared ones); 0 when not swapped."""
        return sum(1 for slot in self._swapped.get(req.request_id, ()) if not isinstance(slot, int))

    def _kept_on_device(self, held: list[KVBlock], num_tokens: int) -> list[bool]:
        """For each of the blocks of a swap-out's `num_tokens` tokens: whether it stays on the
        device. Shared blocks do, unless only part of one is kept (the resumed request would then
        write into it, so it gets a private copy)."""
        full = num_tokens // self.block_size
        return [block.ref_cnt > 1 and i < full for i, block in enumerate(held)]

    def swap_out_size(self, req: Request, num_tokens: int) -> tuple[int, int]:
        """(blocks swap_out would copy, tokens in the leading blocks that stay on the device)."""
        held = self._blocks.get(req.request_id, [])[:self.num_blocks_for(num_tokens)]
        stays = self._kept_on_device(held, num_tokens)
        num_lead = 0
        while num_lead < len(stays) and stays[num_lead]:
            num_lead += 1
        return stays.count(False), num_lead * self.block_size

    def swap_out(self, req: Request, num_tokens: int) -> list[tuple[int, int]] | None:
        """Move the blocks of req's first `num_tokens` tokens off the device; free the rest.

        NOTE: only blocks req holds alone are copied (to CPU blocks) and freed; a full block other
        requests share (ref count > 1) stays referenced on the device, where it holds the same KV
        at resume: copying it would free nothing now and need a new block later. Returns the
        (device block, CPU block) copies, or None, changing nothing, when the CPU pool is short.
        """
        rid = req.request_id
        held = self._blocks.get(rid, [])
        keep = held[:self.num_blocks_for(num_tokens)]
        stays = self._kept_on_device(keep, num_tokens)
        num_copied = stays.count(False)
        if num_copied > self.cpu_pool.num_free_blocks:
            return None
        cpu_ids = iter(self.cpu_pool.allocate(num_copied))
        table: list[KVBlock | int] = []
        copies: list[tuple[int, int]] = []
        released: list[KVBlock] = []
        for block, stay in zip(keep, stays):
            if not stay:
                cpu_id = next(cpu_ids)
                table.append(cpu_id)
                copies.append((block.block_id, cpu_id))
                released.append(block)
            else:
                table.append(block)
        released.extend(held[len(keep):])
        del self._blocks[rid]
        self._num_cached.pop(rid, None)
        self._swapped[rid] = table
        req.block_ids = []
        # NOTE: tail first, as in free(); cached ones stay findable until evicted.
        self.pool.free_blocks(reversed(released))
        return copies

    def swap_in(self, req: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Give a swapped request device blocks again, room for `num_new_tokens` more included.

        Returns the (CPU block, device block) copies, or None, changing nothing, when the device
        pool lacks free blocks.
        """
        rid = req.request_id
        table = self._swapped[rid]
        num_cpu = sum(1 for slot in table if isinstance(slot, int))
        num_extra = max(0, self.num_blocks_for(req.num_computed_tokens + num_new_tokens)
                        - len(table))
        if num_cpu + num_extra > self.pool.num_free_blocks:
            return None
        new = iter(self.pool.get_new_blocks(num_cpu + num_extra))
        held: list[KVBlock] = []
        copies: list[tuple[int, int]] = []
        for slot in table:
            if isinstance(slot, int):
                block = next(new)
                copies.append((slot, block.block_id))
                held.append(block)
            else:
                held.append(slot)
        held.extend(new)
        del self._swapped[rid]
        self.cpu_pool.free([cpu for cpu, _ in copies])
        self._blocks[rid] = held
        self._num_cached[rid] = 0
        req.block_ids = [block.block_id for block in held]
        # The copies land before the step that reads them runs, so the blocks may be found by
        # hash again now (a copy of a block still cached elsewhere just stays unhashed).
        self.cache_computed_blocks(req)
        return copies

    def free(self, req: Request) -> None:
        """Release every block req holds (cached ones stay findable until evicted); idempotent."""
        table = self._swapped.pop(req.request_id, None)
        if table is not None:
            self.cpu_pool.free([slot for slot in table if isinstance(slot, int)])
            self.pool.free_blocks([slot for slot in reversed(table) if isinstance(slot, KVBlock)])
        held = self._blocks.pop(req.request_id, None)
        self._num_cached.pop(req.request_id, None)
        req.block_ids = []
        if held:
            # NOTE: tail blocks are freed first so they are evicted first; the prefix blocks, which
            # other requests are most likely to share, stay cached longest.
            self.pool.free_blocks(reversed(held))

    def reset_prefix_cache(self) -> int:
        """Forget every cached block hash; returns how many were dropped."""
        return self.pool.reset_prefix_cache()
