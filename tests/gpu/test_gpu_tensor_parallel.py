"""Tensor parallelism on two GPUs (NCCL): two worker processes give the one-GPU greedy tokens in
float32, with CUDA graphs (decode and piecewise), chunked prefill and preemption, and eagerly,
with small all-reduces over peer memory and with NCCL alone;
a killed worker ends the engine's requests with an error instead of a hang."""
from __future__ import annotations

import gc
import os
import signal
import time

import pytest
import torch

from peregrine import LLM, SamplingParams
from peregrine.testing.checkpoints import build_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs (tensor_parallel_size=2)"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    # head_dim 128, 8 query / 2 KV heads: each rank holds 4 query heads and 1 KV head.
    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("tp"), "qwen3", dtype=torch.float32,
                                     hidden_size=512, head_dim=128, num_attention_heads=8,
                                     num_key_value_heads=2, intermediate_size=1024,
                                     num_hidden_layers=4, max_position_embeddings=1024))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(5, 500, (40,), generator=g).tolist()
    return [shared + torch.randint(5, 500, (n,), generator=g).tolist()
            for n in (3, 60, 200, 17)] + [torch.randint(5, 500, (n,), generator=g).tolist()
                                          for n in (7, 300)]


def _tokens(path: str, **engine_args) -> list[list[int]]:
    engine_args.setdefault("num_gpu_blocks_override", 512)
    llm = LLM(path, dtype="float32", max_model_len=512, **engine_args)
    try:
        return [list(o.outputs[0].token_ids)
                for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("engine_args", [
    {},  # CUDA graphs, async scheduling; small all-reduces over peer memory
    {"enforce_eager": True},
    # chunked prefill and preemption
    {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 60, "block_size": 16},
    {"disable_custom_all_reduce": True},  # every all-reduce through NCCL
], ids=["graphs", "eager", "chunked-preempted", "nccl-only"])
def test_two_gpus_give_the_one_gpu_greedy_tokens(checkpoint: str, engine_args: dict) -> None:
    want = _tokens(checkpoint, **engine_args)
    got = _tokens(checkpoint, tensor_parallel_size=2, **engine_args)
    assert got == want


def test_a_killed_gpu_worker_fails_the_requests_and_the_health_check(checkpoint: str) -> None:
    llm = LLM(checkpoint, dtype="float32", max_model_len=512, num_gpu_blocks_override=512,
              tensor_parallel_size=2)
    try:
        ex = llm.engine.core_client.core.executor
        os.kill(ex.worker_pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        outs = llm.generate(_prompts()[:2], GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 30
        assert {o.outputs[0].finish_reason for o in outs} == {"error"}
        with pytest.raises(RuntimeError, match="rank 1"):
            llm.engine.check_health()
    finally:
        llm.engine.shutdown()
