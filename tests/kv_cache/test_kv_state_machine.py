"""Randomized check of KVCacheManager against a fake KV store: no leaks, no bad sharing."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from peregrine.engine.request import Request
from peregrine.kv_cache.manager import KVCacheManager
from peregrine.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 12
NUM_CPU_BLOCKS = 6


class KVCacheMachine(RuleBasedStateMachine):
    """Requests are prefilled in chunks, decode, fork, swap out and in, and free under pressure.

    `self.kv[block_id][slot]` plays the model's KV cache: it holds the token whose K/V were
    written there, so every prefix hit, fork or swap-in can be checked against the request's
    tokens; `self.cpu[cpu_block]` plays the CPU swap space.
    """

    @initialize(caching=st.booleans())
    def setup(self, caching: bool) -> None:
        self.mgr = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=caching,
                                  num_cpu_blocks=NUM_CPU_BLOCKS)
        self.reqs: dict[str, Request] = {}
        self.swapped: dict[str, Request] = {}
        self.cpu: dict[int, dict[int, int]] = {}
        self.kv: dict[int, dict[int, int]] = {i: {} for i in range(NUM_BLOCKS)}
        self.num_added = 0

    # ---- helpers --------------------------------------------------------------------------------

    def _pick(self, idx: int) -> Request:
        return self.reqs[sorted(self.reqs)[idx % len(self.reqs)]]

    def _check_kv(self, req: Request, num_tokens: int) -> None:
        for pos in range(num_tokens):
            block_id = req.block_ids[pos // BLOCK_SIZE]
            assert self.kv[block_id].get(pos % BLOCK_SIZE) == req.all_token_ids[pos], \
                f"{req} reuses block {block_id} holding other tokens at position {pos}"

    def _compute(self, req: Request, num: int) -> None:
        """Fake forward pass: write K/V of the next `num` tokens, then cache full blocks."""
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + num):
            block = self.mgr.pool.blocks[req.block_ids[pos // BLOCK_SIZE]]
            assert block.ref_cnt == 1 and block.block_hash is None, f"write into shared {block}"
            self.kv[block.block_id][pos % BLOCK_SIZE] = req.all_token_ids[pos]
        req.num_computed_tokens += num
        self.mgr.cache_computed_blocks(req)

    def _free_snapshot(self) -> tuple[int, list[int]]:
        return self.mgr.num_free_blocks, [b.ref_cnt for b in self.mgr.pool.blocks]

    # ---- rules ----------------------------------------------------------------------------------

    @rule(family=st.integers(0, 2), length=st.integers(1, 24), diverge=st.integers(0, 24),
          chunk=st.integers(1, 24))
    def add(self, family: int, length: int, diverge: int, chunk: int) -> None:
        tokens = [family * 1000 + i if i < diverge else 7 for i in range(length)]
        req = Request(f"r{self.num_added}", tokens, SamplingParams(), arrival_time=0.0,
                      max_tokens=64)
        self.num_added += 1
        computed = self.mgr.get_computed_blocks(req)
        assert computed.num_tokens < req.num_tokens
        before = self._free_snapshot()
        num_new = min(chunk, req.num_tokens - computed.num_tokens)
        if not self.mgr.allocate_slots(req, num_new, computed):
            assert self._free_snapshot() == before and req.block_ids == []
            return
        req.num_computed_tokens = computed.num_tokens
        self._check_kv(req, computed.num_tokens)
        self.reqs[req.request_id] = req
        self._compute(req, num_new)

    @precondition(lambda self: self.reqs)
    @rule(idx=st.integers(0, 99), chunk=st.integers(1, 8), token=st.integers(0, 3))
    def step(self, idx: int, chunk: int, token: int) -> None:
        req = self._pick(idx)
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(token)  # decode: the sampled token's K/V come next
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        before = self._free_snapshot()
        num_blocks_before = len(req.block_ids)
        if self.mgr.allocate_slots(req, num_new):
            self._compute(req, num_new)
        else:
            assert self._free_snapshot() == before and len(req.block_ids) == num_blocks_before

    @precondition(lambda self: self.reqs)
    @rule(idx=st.integers(0, 99))
    def fork(self, idx: int) -> None:
        src = self._pick(idx)
        dst = Request(f"r{self.num_added}", list(src.all_token_ids), SamplingParams(),
                      arrival_time=0.0, max_tokens=64, fork_source=src)
        self.num_added += 1
        shared = self.mgr.fork(src, dst, min(src.num_computed_tokens, dst.num_tokens - 1))
        dst.num_computed_tokens = shared
        self._check_kv(dst, shared)
        self.reqs[dst.request_id] = dst

    @precondition(lambda self: self.reqs)
    @rule(idx=st.integers(0, 99))
    def free(self, idx: int) -> None:
        req = self._pick(idx)
        self.mgr.free(req)
        del self.reqs[req.request_id]
        assert req.block_ids == []

    @precondition(lambda self: self.reqs)
    @rule(idx=st.integers(0, 99), keep=st.integers(0, 24))
    def swap_out(self, idx: int, keep: int) -> None:
        req = self._pick(idx)
        num = min(keep, req.num_computed_tokens)
        before = (self._free_snapshot(), self.mgr.num_free_cpu_blocks, list(req.block_ids))
        copies = self.mgr.swap_out(req, num)
        if copies is None:
            assert (self._free_snapshot(), self.mgr.num_free_cpu_blocks,
                    req.block_ids) == before
            return
        assert [dev for dev, _ in copies] == [b for b in before[2][:-(-num // BLOCK_SIZE)]
                                              if b in {d for d, _ in copies}]
        for dev, cpu in copies:
            assert cpu not in self.cpu, f"CPU block {cpu} handed out twice"
            self.cpu[cpu] = dict(self.kv[dev])
        req.num_computed_tokens = num
        assert req.block_ids == [] and self.mgr.is_swapped(req)
        self.swapped[req.request_id] = self.reqs.pop(req.request_id)

    @precondition(lambda self: self.swapped)
    @rule(idx=st.integers(0, 99), chunk=st.integers(0, 8))
    def swap_in(self, idx: int, chunk: int) -> None:
        req = self.swapped[sorted(self.swapped)[idx % len(self.swapped)]]
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        before = (self._free_snapshot(), self.mgr.num_free_cpu_blocks)
        copies = self.mgr.swap_in(req, num_new)
        if copies is None:
            assert (self._free_snapshot(), self.mgr.num_free_cpu_blocks) == before
            return
        for cpu, dev in copies:
            self.kv[dev] = self.cpu.pop(cpu)
        self.reqs[req.request_id] = self.swapped.pop(req.request_id)
        assert not self.mgr.is_swapped(req)
        self._check_kv(req, req.num_computed_tokens)
        if num_new:
            self._compute(req, num_new)

    @precondition(lambda self: self.swapped)
    @rule(idx=st.integers(0, 99))
    def free_swapped(self, idx: int) -> None:
        req = self.swapped.pop(sorted(self.swapped)[idx % len(self.swapped)])
        table = self.mgr._swapped[req.request_id]
        self.mgr.free(req)
        for slot in table:
            if isinstance(slot, int):
                del self.cpu[slot]
        assert not self.mgr.is_swapped(req)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.mgr.reset_prefix_cache()
        assert self.mgr.pool.cached == {}

    # ---- invariants -----------------------------------------------------------------------------

    @invariant()
    def ref_counts_match_owners(self) -> None:
        owners = [0] * NUM_BLOCKS
        for req in self.reqs.values():
            assert len(req.block_ids) == len(set(req.block_ids))
            assert len(req.block_ids) >= -(-req.num_computed_tokens // BLOCK_SIZE)
            for block_id in req.block_ids:
                owners[block_id] += 1
        for req in self.swapped.values():
            for slot in self.mgr._swapped[req.request_id]:
                if not isinstance(slot, int):
                    owners[slot.block_id] += 1  # shared blocks stay held while swapped
        assert [b.ref_cnt for b in self.mgr.pool.blocks] == owners  # never negative, no leak

    @invariant()
    def free_plus_used_is_total(self) -> None:
        used = sum(1 for b in self.mgr.pool.blocks if b.ref_cnt > 0)
        assert self.mgr.num_free_blocks + used == NUM_BLOCKS
        free_ids = self.mgr.pool.free_queue.block_ids()
        assert sorted(free_ids) == [b.block_id for b in self.mgr.pool.blocks if b.ref_cnt == 0]

    @invariant()
    def hash_map_is_consistent(self) -> None:
        for block_hash, block in self.mgr.pool.cached.items():
            assert block.block_hash == block_hash
        hashed = [b for b in self.mgr.pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(self.mgr.pool.cached)
        if not self.mgr.enable_caching:
            assert not hashed

    @invariant()
    def cpu_blocks_are_owned_once(self) -> None:
        held = [slot for req in self.swapped.values()
                for slot in self.mgr._swapped[req.request_id] if isinstance(slot, int)]
        assert len(held) == len(set(held)) and sorted(held) == sorted(self.cpu)
        assert self.mgr.num_free_cpu_blocks + len(held) == NUM_CPU_BLOCKS

    @invariant()
    def counters_are_consistent(self) -> None:
        assert 0 <= self.mgr.prefix_cache_hits <= self.mgr.prefix_cache_queries


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                            deadline=None)
test_kv_cache_state_machine = KVCacheMachine.TestCase
