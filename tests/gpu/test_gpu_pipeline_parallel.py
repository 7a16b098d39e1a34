"""Pipeline parallelism on two GPUs (NCCL): two stages give the one-GPU greedy tokens in
float32 (even and uneven layer splits, chunked prefill and preemption), agree with one GPU in
bfloat16 within the rounding bound of test_gpu_engine.py (as do two tensor-parallel ranks), report
their idle time, and a killed stage worker ends the engine's requests with an error naming it."""
from __future__ import annotations

import gc
import math
import os
import signal
import time

import pytest
import torch
from test_gpu_engine import (BF16_NEAR_TIE, BF16_PAIR_SIGMA, GREEDY, ORACLE_DEVICE, _checkpoint,
                             _normal_tail, _prompts, _top1)

from peregrine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs (pipeline_parallel_size=2)"),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("pp")


@pytest.fixture(scope="module")
def fp32_path(root) -> str:
    return _checkpoint(root / "fp32", torch.float32)


def _generate(path: str, prompts, params: SamplingParams, **engine_args):
    engine_args.setdefault("num_gpu_blocks_override", 512)
    llm = LLM(path, max_model_len=512, **engine_args)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        if engine_args.get("pipeline_parallel_size", 1) > 1:
            core = llm.engine.core_client.core
            assert core.pipeline.max_in_flight == 2  # both stages had a step at once
            stats = core.executor.stage_stats()
            assert len(stats) == 2 and all(s["steps"] > 0 for s in stats)
        return outs
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("partition,engine_args", [
    (None, {}),
    ("3,1", {}),
    # chunked prefill and preemption
    ("1,3", {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 60, "block_size": 16}),
], ids=["even", "uneven", "chunked-preempted"])
def test_two_stages_give_the_one_gpu_fp32_greedy_tokens(fp32_path: str, monkeypatch, partition,
                                                         engine_args: dict) -> None:
    path = fp32_path
    want = _tokens(_generate(path, _prompts(), GREEDY, dtype="float32", **engine_args))
    if partition is not None:
        monkeypatch.setenv("PEREGRINE_PP_LAYER_PARTITION", partition)
    got = _tokens(_generate(path, _prompts(), GREEDY, dtype="float32",
                            pipeline_parallel_size=2, **engine_args))
    assert got == want


@pytest.mark.parametrize("split", [{"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}],
                         ids=["pp2", "tp2"])
def test_two_gpus_agree_with_one_gpu_in_bf16_within_rounding(root, record_property,
                                                              split: dict) -> None:
    path = _checkpoint(root / "bf16", torch.bfloat16)
    prompts = _prompts()
    one = _generate(path, prompts, GREEDY, dtype="bfloat16")
    # Teacher-forced on the one-GPU continuation: both see the same tokens everywhere.
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, one)]
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    tf = {n: _generate(path, seqs, forced, dtype="bfloat16", enable_prefix_caching=False, **args)
          for n, args in ((1, {}), (2, split))}
    from transformers import AutoModelForCausalLM
    exact_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    exact_model = exact_model.to(ORACLE_DEVICE).eval()
    positions, gaps, expected = 0, [], 0.0
    with torch.no_grad():
        for si, (prompt, seq) in enumerate(zip(prompts, seqs)):
            logits = exact_model(torch.tensor([seq], device=ORACLE_DEVICE)).logits[0].float()
            rows = logits[len(prompt) - 1:len(seq) - 1]  # (n, V): row i predicts len(p) + i
            rms = rows.pow(2).mean(-1).sqrt()  # (n,)
            below_top = rows.max(-1, keepdim=True).values - rows  # (n, V)
            tails = _normal_tail(below_top / (BF16_PAIR_SIGMA * rms[:, None]))  # (n, V)
            expected += float(2 * (tails.sum(-1) - 0.5).clamp(0.0, 1.0).sum())
            for i, pos in enumerate(range(len(prompt), len(seq))):
                a = _top1(tf[1][si].prompt_logprobs[pos])
                b = _top1(tf[2][si].prompt_logprobs[pos])
                positions += 1
                if a != b:
                    gaps.append(float((rows[i, a] - rows[i, b]).abs() / rms[i]))
    del exact_model
    torch.cuda.empty_cache()
    record_property("bf16_disagreement_gaps_over_rms", gaps)
    record_property("bf16_top1_agreement", 1 - len(gaps) / positions)
    assert positions > 0
    assert all(gap <= BF16_NEAR_TIE for gap in gaps), gaps
    assert len(gaps) <= math.floor(expected + 3 * math.sqrt(expected)), (len(gaps), expected)


def test_a_killed_stage_worker_fails_the_requests_and_the_health_check(fp32_path: str) -> None:
    path = fp32_path
    llm = LLM(path, dtype="float32", max_model_len=512, num_gpu_blocks_override=512,
              pipeline_parallel_size=2)
    try:
        ex = llm.engine.core_client.core.executor
        os.kill(ex.worker_pids[0], signal.SIGKILL)  # the first stage
        t0 = time.monotonic()
        outs = llm.generate(_prompts()[:2], GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 30
        assert {o.outputs[0].finish_reason for o in outs} == {"error"}
        with pytest.raises(RuntimeError, match=r"worker rank 0 \(pipeline stage 0"):
            llm.engine.check_health()
    finally:
        llm.engine.shutdown()
