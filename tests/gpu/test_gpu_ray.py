"""Tensor and pipeline parallelism over Ray on two GPUs (NCCL): two Ray actors (two tensor-parallel
ranks, with CUDA graphs and eagerly, or two pipeline stages) give the one-GPU greedy tokens in
float32; a killed actor ends the requests with an error naming its rank; shutdown gives the GPUs
back.

Run with `pytest -m "gpu and ray" tests/gpu/test_gpu_ray.py` (needs Ray: the ray extra)."""
from __future__ import annotations

import gc
import time

import pytest
import torch

from peregrine import LLM, SamplingParams
from peregrine.testing.checkpoints import build_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.ray,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs (two ranks)"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def ray():
    """The ray module, with one local Ray instance (this host's GPUs) for the module."""
    import ray
    ray.init(include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


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
    llm = LLM(path, dtype="float32", max_model_len=512, num_gpu_blocks_override=512,
              **engine_args)
    try:
        return [list(o.outputs[0].token_ids)
                for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("engine_args", [{}, {"enforce_eager": True}], ids=["graphs", "eager"])
def test_two_gpu_actors_give_the_one_gpu_greedy_tokens(ray, checkpoint: str,
                                                       engine_args: dict) -> None:
    want = _tokens(checkpoint, **engine_args)
    got = _tokens(checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray",
                  **engine_args)
    assert got == want
    # the placement group is gone: both GPUs are free again
    deadline = time.monotonic() + 10
    while ray.available_resources().get("GPU", 0) < ray.cluster_resources()["GPU"]:
        assert time.monotonic() < deadline, "the actors' GPUs were not given back"
        time.sleep(0.1)


def test_two_pipeline_stage_actors_give_the_one_gpu_greedy_tokens(ray, checkpoint: str) -> None:
    want = _tokens(checkpoint)
    got = _tokens(checkpoint, pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert got == want


def test_a_killed_gpu_actor_fails_the_requests_and_the_health_check(ray, checkpoint: str):
    llm = LLM(checkpoint, dtype="float32", max_model_len=512, num_gpu_blocks_override=512,
              tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        ex = llm.engine.core_client.core.executor
        ray.kill(ex.worker_actors[1])
        t0 = time.monotonic()
        outs = llm.generate(_prompts()[:2], GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 30
        assert {o.outputs[0].finish_reason for o in outs} == {"error"}
        with pytest.raises(RuntimeError, match="rank 1"):
            llm.engine.check_health()
    finally:
        llm.engine.shutdown()
