"""Start-up on CUDA: the demo model's KV pool is capped at what its batch can use, the start-up
line accounts for every GPU phase, and the precompiled decode merge variants cover every batch."""
from __future__ import annotations

import gc
import math

import pytest
import torch

from peregrine import LLM, SamplingParams, demo
from peregrine.kernels._utils import next_pow2
from peregrine.kernels.decode_attention import decode_num_splits, max_decode_splits
from peregrine.worker.kv_memory import gpu_blocks_cap

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def demo_llm():
    llm = LLM(str(demo.demo_model_path()), dtype="bfloat16", seed=0)
    yield llm
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_the_demo_kv_pool_is_capped_at_a_full_batch(demo_llm) -> None:
    config = demo_llm.engine.config
    scheduler = demo_llm.engine.core_client.core.scheduler
    assert scheduler.kv.num_blocks == gpu_blocks_cap(config)
    # 256 sequences of 512 tokens in bf16: about 0.5 GiB of KV, not the whole GPU.
    kv = demo_llm.engine.core_client.core.executor.worker.model_runner.kv_caches
    assert sum(t.numel() * t.element_size() for pair in kv for t in pair) < 2**30
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    out = demo_llm.generate(["def fibonacci(n):"], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 16


def test_the_start_up_line_covers_every_gpu_phase(demo_llm) -> None:
    s = demo_llm.engine.startup_seconds
    for phase in ("device", "attention_backend", "model", "runner", "kv_profile", "kv_alloc",
                  "precompile", "decode_graphs", "piecewise_graphs", "sampler_warmup"):
        assert s.get(f"engine_core/{phase}", 0.0) > 0.0, phase
    nested = sum(v for k, v in s.items() if k.startswith("engine_core/"))
    assert nested == pytest.approx(s["engine_core"], rel=1e-6)


@pytest.mark.parametrize("max_model_len", [512, 4096, 8192, 32768])
def test_every_decode_batch_uses_a_precompiled_merge_variant(max_model_len: int) -> None:
    """The merge's BLOCK_S over every batch size and block-table width stays within the powers
    of two precompile(max_context=max_model_len) compiles, at this GPU's SM count."""
    dev = torch.device("cuda")
    compiled = next_pow2(max_decode_splits(max_model_len))
    for kv_heads in (1, 2, 8):
        for batch in (1, 2, 7, 64, 256):
            for blocks in range(1, max_model_len // 16 + 1, max(1, max_model_len // 16 // 64)):
                splits = decode_num_splits(batch, kv_heads, blocks, 16, dev)
                assert next_pow2(splits) <= compiled
