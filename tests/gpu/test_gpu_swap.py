"""Preemption by swap on a GPU: pinned copies at Llama-3-8B block shapes without a host sync,
ordered behind queued device work, and greedy tokens through LLM equal to recompute's."""
from __future__ import annotations

import gc

import pytest
import torch

from peregrine import LLM, SamplingParams
from peregrine.testing.checkpoints import build_tiny_checkpoint
from peregrine.worker.swap import KVSwapSpace

pytestmark = pytest.mark.gpu


def _llama3_8b_caches(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """32 layers of (num_blocks, 16, 8, 128) bf16 K and V: 2 MiB per block."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def one() -> torch.Tensor:
        return torch.randn((num_blocks, 16, 8, 128), generator=g, device="cuda").bfloat16()
    return [(one(), one()) for _ in range(32)]


def test_round_trip_at_llama3_8b_shapes_without_host_sync() -> None:
    caches = _llama3_8b_caches(64)
    want = [(k.clone(), v.clone()) for k, v in caches]
    space = KVSwapSpace(caches, 96, torch.device("cuda"))
    assert space.cpu.is_pinned() and space.block_bytes == 2 << 20
    out = [(i, 95 - 2 * i) for i in range(40)]  # 40 single-block runs, out of order
    back = [(cpu, (dev + 17) % 64) for dev, cpu in out]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        space.swap_out(out)
        for k, v in caches:
            k.zero_()
            v.zero_()
        space.swap_in(back)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for (k, v), (wk, wv) in zip(caches, want):
        for dev, cpu in out:
            assert torch.equal(k[(dev + 17) % 64], wk[dev])
            assert torch.equal(v[(dev + 17) % 64], wv[dev])


def test_swap_out_sees_kv_written_by_work_still_queued() -> None:
    caches = _llama3_8b_caches(8)
    space = KVSwapSpace(caches, 8, torch.device("cuda"))
    torch.cuda.synchronize()
    a = torch.randn(8192, 8192, device="cuda")
    for _ in range(4):
        a = a @ a / 100.0  # keeps the stream busy while the host queues the rest
    for k, v in caches:
        k[3].fill_(7.0)
        v[3].fill_(-7.0)
    space.swap_out([(3, 5)])  # queued behind the fills, no sync in between
    torch.cuda.synchronize()
    cpu = space.cpu[5].view(64, -1).view(torch.bfloat16)  # (2 x 32 cache tensors, block elems)
    assert bool((cpu[0::2] == 7.0).all()) and bool((cpu[1::2] == -7.0).all())


def _tokens(path: str, mode: str, **kw) -> tuple[list[list[int]], object]:
    llm = LLM(path, dtype="float32", max_model_len=512, preemption_mode=mode,
              num_gpu_blocks_override=40, **kw)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(5, 500, (n,), generator=g).tolist()
                   for n in (7, 33, 100, 250, 16, 64)]
        params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.core_client.core.scheduler.make_stats()
        return [list(o.outputs[0].token_ids) for o in outs], stats
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_tokens_with_swapping_equal_recompute(tmp_path, monkeypatch,
                                                     async_scheduling: bool) -> None:
    path = str(build_tiny_checkpoint(tmp_path, "qwen3", hidden_size=512, head_dim=128,
                                     num_attention_heads=8, num_key_value_heads=2,
                                     intermediate_size=1024, num_hidden_layers=4,
                                     max_position_embeddings=1024))
    ref, ref_stats = _tokens(path, "recompute", async_scheduling=async_scheduling)
    assert ref_stats.num_preemptions > 0 and ref_stats.num_swapped_out == 0
    real = KVSwapSpace.swap_out

    def poisoned(self: KVSwapSpace, copies: list[tuple[int, int]]) -> None:
        real(self, copies)  # then overwrite the freed blocks: only the swap-in restores them
        if copies:
            idx = torch.tensor([dev for dev, _ in copies], device=self.device)
            for flat in self._flat:
                flat.index_fill_(0, idx, 0x3C)
    monkeypatch.setattr(KVSwapSpace, "swap_out", poisoned)
    got, stats = _tokens(path, "swap", async_scheduling=async_scheduling)
    assert stats.num_swapped_out > 0 and stats.num_swapped_in == stats.num_swapped_out
    assert got == ref
