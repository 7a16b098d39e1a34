"""Preemption by swap: the block copies themselves, and greedy tokens through the engine equal
those of a run that never preempts."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from peregrine import LLM, SamplingParams
from peregrine.attention.kv_dtype import kv_cache_bytes_per_block
from peregrine.config import EngineArgs
from peregrine.engine.request import RequestStatus
from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.worker import swap as swap_mod
from peregrine.worker.swap import KVSwapSpace

PROMPT_LENS = (5, 17, 33, 48, 21, 40)
NEW_TOKENS = 24


# ---- the copies ----------------------------------------------------------------------------------

def _caches(num_blocks: int, dtype: torch.dtype, layers: int = 3) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)

    def one() -> torch.Tensor:
        return torch.randn((num_blocks, 4, 2, 8), generator=g).to(dtype)  # (N, bs, Hkv, D)
    return [(one(), one()) for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("chunk", [1, 2, 64])
def test_blocks_round_trip_through_the_swap_space(dtype: torch.dtype, chunk: int) -> None:
    caches = _caches(8, dtype)
    want = [(k.clone(), v.clone()) for k, v in caches]
    space = KVSwapSpace(caches, 10, torch.device("cpu"))
    space._chunk = chunk  # several staging rounds
    out = [(5, 7), (1, 2), (6, 3), (2, 8)]  # CPU ids unsorted, two runs: 2..3 and 7..8
    space.swap_out(out)
    for k, v in caches:
        k.view(torch.uint8).fill_(0x7F)
        v.view(torch.uint8).fill_(0x7F)
    back = [(7, 0), (2, 4), (3, 3), (8, 6)]  # each CPU block to another device block
    space.swap_in(back)
    for (k, v), (wk, wv) in zip(caches, want):
        for src, dst in ((5, 0), (1, 4), (6, 3), (2, 6)):
            assert torch.equal(k[dst].view(torch.uint8), wk[src].view(torch.uint8))
            assert torch.equal(v[dst].view(torch.uint8), wv[src].view(torch.uint8))
        untouched = [1, 2, 5, 7]
        assert bool((k[untouched].view(torch.uint8) == 0x7F).all())


def test_swap_space_refuses_block_ids_out_of_range() -> None:
    space = KVSwapSpace(_caches(4, torch.float32), 2, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"CPU block ids must be in \[0, 2\)"):
        space.swap_out([(0, 2)])
    with pytest.raises(ValueError, match=r"device block ids must be in \[0, 4\)"):
        space.swap_in([(0, 4)])


def test_runs_of_consecutive_ids() -> None:
    assert swap_mod._runs(np.array([0, 1, 2, 5, 6, 9])) == [(0, 3), (3, 5), (5, 6)]
    assert swap_mod._runs(np.array([4])) == [(0, 1)]


# ---- through the engine ----------------------------------------------------------------------------

def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(99)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _generate(**engine_args) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(tiny_checkpoint("qwen3")), dtype="float32", device="cpu", max_model_len=128,
              seed=0, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@functools.lru_cache(maxsize=None)
def _reference() -> list[list[int]]:
    llm, tokens = _generate(preemption_mode="recompute")
    assert llm.engine.get_stats().num_preemptions == 0
    return tokens


def _scheduler(llm: LLM):
    return llm.engine.core_client.core.scheduler


@pytest.fixture
def poisoned_swap_out(monkeypatch):
    """After each swap-out, overwrite the freed device blocks: only the swap-in can restore them."""
    real = KVSwapSpace.swap_out

    def swap_out(self: KVSwapSpace, copies: list[tuple[int, int]]) -> None:
        real(self, copies)
        if copies:
            idx = torch.tensor([dev for dev, _ in copies])
            for flat in self._flat:
                flat.index_fill_(0, idx, 0x3C)
    monkeypatch.setattr(KVSwapSpace, "swap_out", swap_out)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forced_swapping_gives_the_tokens_of_a_run_without_preemption(
        poisoned_swap_out, prefix_caching: bool, async_scheduling: bool) -> None:
    llm, tokens = _generate(preemption_mode="swap", num_gpu_blocks_override=8,
                            max_num_batched_tokens=16, enable_prefix_caching=prefix_caching,
                            async_scheduling=async_scheduling)
    stats = _scheduler(llm).make_stats()
    assert stats.num_swapped_out > 0, "swapping was not exercised"
    assert stats.num_swapped_in == stats.num_swapped_out and stats.num_swapped == 0
    engine_stats = llm.engine.get_stats()  # what /metrics reads
    assert engine_stats.num_swapped_out == stats.num_swapped_out
    assert engine_stats.num_swapped_in == stats.num_swapped_in and engine_stats.num_swapped == 0
    assert tokens == _reference()


def test_swap_in_that_copies_nothing_breaks_the_tokens(poisoned_swap_out, monkeypatch) -> None:
    """The equality above depends on the copies: without the swap-in the tokens change."""
    monkeypatch.setattr(KVSwapSpace, "swap_in", lambda self, copies: None)
    llm, tokens = _generate(preemption_mode="swap", num_gpu_blocks_override=8,
                            max_num_batched_tokens=16)
    assert _scheduler(llm).make_stats().num_swapped_out > 0
    assert tokens != _reference()


def test_a_full_swap_space_falls_back_to_recompute_with_the_same_tokens(
        poisoned_swap_out) -> None:
    config = EngineArgs(str(tiny_checkpoint("qwen3")), dtype="float32",
                        device="cpu").create_engine_config()
    per_block = kv_cache_bytes_per_block(config.cache, config.model)
    llm, tokens = _generate(preemption_mode="swap", num_gpu_blocks_override=8,
                            max_num_batched_tokens=16, swap_space=3 * per_block / 2**30)
    stats = _scheduler(llm).make_stats()
    assert _scheduler(llm).kv.cpu_pool.num_blocks == 3
    assert 0 < stats.num_swapped_out < stats.num_preemptions  # some swapped, some recomputed
    assert tokens == _reference()


def test_auto_mode_gives_the_same_tokens(poisoned_swap_out) -> None:
    llm, tokens = _generate(preemption_mode="auto", num_gpu_blocks_override=8,
                            max_num_batched_tokens=16, async_scheduling=True)
    assert _scheduler(llm).make_stats().num_preemptions > 0
    assert tokens == _reference()


def test_aborting_a_swapped_request_frees_its_blocks() -> None:
    llm = LLM(str(tiny_checkpoint("qwen3")), dtype="float32", device="cpu", max_model_len=128,
              seed=0, preemption_mode="swap", num_gpu_blocks_override=8,
              max_num_batched_tokens=16)
    engine, sched = llm.engine, _scheduler(llm)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(_prompts()):
        engine.add_request(str(i), prompt, params)
    swapped = None
    for _ in range(200):
        engine.step()
        swapped = next((r for r in sched.waiting if r.status == RequestStatus.SWAPPED), None)
        if swapped is not None:
            break
    assert swapped is not None, "no request was swapped"
    assert sched.kv.num_free_cpu_blocks < sched.kv.cpu_pool.num_blocks
    engine.abort_request(swapped.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert swapped.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_free_cpu_blocks == sched.kv.cpu_pool.num_blocks
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
    assert sched.make_stats().num_swapped == 0


def test_seeded_sampling_draws_the_same_tokens_after_swapping(poisoned_swap_out) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = []
    for kw in ({"preemption_mode": "recompute"},
               {"preemption_mode": "swap", "num_gpu_blocks_override": 8,
                "max_num_batched_tokens": 16, "async_scheduling": True}):
        llm = LLM(str(tiny_checkpoint("qwen3")), dtype="float32", device="cpu", max_model_len=128,
                  seed=0, **kw)
        runs.append([o.outputs[0].token_ids for o in llm.generate(_prompts(), params,
                                                                   use_tqdm=False)])
        swapped = _scheduler(llm).make_stats().num_swapped_out
    assert swapped > 0 and runs[0] == runs[1]


# ---- configuration ---------------------------------------------------------------------------------

def _config(**kw):
    return EngineArgs(str(tiny_checkpoint("qwen3")), dtype="float32", device="cpu",
                      **kw).create_engine_config()


def test_swap_space_is_sized_in_blocks_of_the_kv_cache() -> None:
    # NOTE: small enough to stay under the cap of max_num_seqs full-length sequences.
    config = _config(swap_space=2 ** -10, kv_cache_dtype="bfloat16")
    per_block = kv_cache_bytes_per_block(config.cache, config.model)
    assert config.cache.num_cpu_blocks == (1 << 20) // per_block > 0
    assert config.scheduler.preemption_mode == "auto"
    assert config.scheduler.swap_cost.bytes_per_block == per_block
    assert _config(preemption_mode="recompute").cache.num_cpu_blocks == 0
    assert _config(swap_space=0).cache.num_cpu_blocks == 0


@pytest.mark.parametrize("kw, match", [
    ({"preemption_mode": "spill"}, "invalid preemption_mode: 'spill'"),
    ({"swap_space": -1.0}, "invalid swap_space: must be >= 0"),
    ({"preemption_mode": "swap", "swap_space": 0}, "swap needs swap_space > 0"),
])
def test_bad_swap_settings_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(**kw)


@pytest.mark.slow
def test_two_tensor_parallel_ranks_swap_their_own_shards() -> None:
    """Each rank copies its heads' share of the blocks the scheduler names: tokens unchanged."""
    args = dict(dtype="float32", device="cpu", max_model_len=128, seed=0, block_size=4,
                max_num_batched_tokens=16, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    path = str(tiny_checkpoint("qwen3"))
    want = [o.outputs[0].token_ids for o in LLM(path, preemption_mode="recompute", **args)
            .generate(_prompts(), params, use_tqdm=False)]
    llm = LLM(path, tensor_parallel_size=2, preemption_mode="swap", num_gpu_blocks_override=32,
              async_scheduling=True, **args)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
        assert _scheduler(llm).make_stats().num_swapped_out > 0
        assert got == want
    finally:
        llm.engine.shutdown()
