"""Peregrine's greedy tokens and logprobs equal transformers' on tiny float32 checkpoints."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from peregrine import LLM, SamplingParams
from peregrine.testing.checkpoints import ARCHS, tiny_checkpoint
from peregrine.testing.oracle import hf_greedy

NEW_TOKENS = 32
PROMPT_LENS = (5, 17, 33, 48)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


# Sliding windows shorter than the prompts: Mistral windows every layer; Qwen2 (as transformers
# reads use_sliding_window / max_window_layers) only the layers from max_window_layers on.
_WINDOWED = {
    "mistral": dict(sliding_window=8),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
}


@functools.lru_cache(maxsize=None)
def _hf_reference(arch: str, windowed: bool = False
                  ) -> tuple[list[list[int]], list[list[list[float]]]]:
    """Greedy continuations and per-step full log-softmax rows from transformers (on the
    sliding-window variant of the checkpoint with windowed=True)."""
    path = tiny_checkpoint(arch, **(_WINDOWED[arch] if windowed else {}))
    return hf_greedy(path, _prompts, NEW_TOKENS)


def _run(arch: str, **engine_args) -> list:
    path = tiny_checkpoint(arch)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256, seed=0, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    return llm, llm.generate(_prompts(llm.engine.config.model.vocab_size), params, use_tqdm=False)


def _check(arch: str, outs) -> None:
    ref_tokens, ref_lps = _hf_reference(arch)
    for out, want, want_lp in zip(outs, ref_tokens, ref_lps):
        got = out.outputs[0].token_ids
        assert got == want, f"{arch}: greedy tokens differ from transformers"
        for pos, entry in enumerate(out.outputs[0].logprobs):
            row = want_lp[pos]
            for tok, lp in entry.items():
                assert math.isclose(lp.logprob, row[tok].item(), abs_tol=1e-4), (arch, pos, tok)
            top = torch.topk(row, 3).indices.tolist()
            assert set(top) <= set(entry), f"{arch}: top-3 logprob tokens differ at step {pos}"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch: str) -> None:
    _, outs = _run(arch)
    _check(arch, outs)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("mode", ["chunked", "preempt", "chunked+preempt"])
def test_greedy_matches_with_scheduler_pressure(mode: str, prefix_caching: bool,
                                                async_scheduling: bool) -> None:
    args: dict = {"enable_prefix_caching": prefix_caching, "async_scheduling": async_scheduling}
    if "chunked" in mode:
        args["max_num_batched_tokens"] = 16
    if "preempt" in mode:
        args["num_gpu_blocks_override"] = 8  # 4 requests need up to 20 blocks at once
    llm, outs = _run("qwen3", **args)
    _check("qwen3", outs)
    if "preempt" in mode:
        assert llm.engine.get_stats().num_preemptions > 0, "preemption was not exercised"


def test_shared_prefix_hits_cache_and_matches() -> None:
    llm, first = _run("llama", enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    second = llm.generate(_prompts(llm.engine.config.model.vocab_size), params, use_tqdm=False)
    _check("llama", second)
    # Full blocks of each prompt are found again; the last prompt token is always recomputed.
    assert [o.num_cached_tokens for o in second] == [((n - 1) // 16) * 16 for n in PROMPT_LENS]
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits >= sum(((n - 1) // 16) * 16 for n in PROMPT_LENS)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("mode", ["whole", "chunked", "chunked+preempt"])
def test_piecewise_graph_path_matches_transformers(mode: str, prefix_caching: bool) -> None:
    """The piecewise-graph execution (run eagerly here: no CUDA) over padded fixed buffers gives
    transformers' tokens; steps above the largest size fall back to the plain forward."""
    from peregrine.worker.cuda_graphs import PiecewiseGraphs, prefill_graph_sizes
    args: dict = {"enable_prefix_caching": prefix_caching, "async_scheduling": True}
    if "chunked" in mode:
        args["max_num_batched_tokens"] = 16
    if "preempt" in mode:
        args["num_gpu_blocks_override"] = 8
    path = tiny_checkpoint("qwen3")
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256, seed=0, **args)
    runner = llm.engine.core_client.core.executor.worker.model_runner
    # NOTE: sizes up to 64: the 103-token first step of "whole" runs eagerly, the rest padded.
    pw = PiecewiseGraphs(runner.model, runner.buffers, runner.kv_caches,
                         prefill_graph_sizes(min(64, runner.max_num_tokens)), capture=False)
    used: list[int] = []
    run = pw.run
    pw.run = lambda n, meta: used.append(n) or run(n, meta)
    runner.prefill_graphs = pw
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate(_prompts(llm.engine.config.model.vocab_size), params, use_tqdm=False)
    _check("qwen3", outs)
    assert used and any(pw.padded(n) > n for n in used), "padded piecewise steps did not run"
    if "preempt" in mode:
        assert llm.engine.get_stats().num_preemptions > 0, "preemption was not exercised"




@pytest.mark.parametrize("mode", ["plain", "chunked+preempt", "no-prefix-cache",
                                  pytest.param("triton", marks=pytest.mark.slow)])
@pytest.mark.parametrize("arch", sorted(_WINDOWED))
def test_sliding_window_matches_transformers(arch: str, mode: str) -> None:
    from peregrine.models.registry import model_class
    path = tiny_checkpoint(arch, **_WINDOWED[arch])
    args: dict = {}
    if mode == "chunked+preempt":
        args.update(max_num_batched_tokens=16, num_gpu_blocks_override=8)
    if mode == "no-prefix-cache":
        args.update(enable_prefix_caching=False)
    if mode == "triton":
        args.update(attention_backend="triton", max_num_batched_tokens=32)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256, seed=0, **args)
    mc = llm.engine.config.model
    windows = model_class(mc.architecture).layer_windows(mc.hf_config)
    assert windows == ([8, 8] if arch == "mistral" else [None, 8])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate(_prompts(llm.engine.config.model.vocab_size), params, use_tqdm=False)
    ref_tokens, ref_lps = _hf_reference(arch, windowed=True)
    for out, want, want_lp in zip(outs, ref_tokens, ref_lps):
        assert out.outputs[0].token_ids == want, f"{arch} {mode}: greedy tokens differ"
        for pos, entry in enumerate(out.outputs[0].logprobs):
            for tok, lp in entry.items():
                assert math.isclose(lp.logprob, want_lp[pos][tok].item(), abs_tol=1e-4)
    if mode == "chunked+preempt":
        assert llm.engine.get_stats().num_preemptions > 0


def test_layer_windows_follow_the_config() -> None:
    from peregrine.models.registry import model_class
    llama, mistral, qwen2, qwen3 = (model_class(a).layer_windows for a in (
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"))
    base = {"num_hidden_layers": 3}
    assert llama(dict(base, sliding_window=4096)) == [None] * 3
    assert mistral(dict(base, sliding_window=None)) == [None] * 3
    assert mistral(dict(base, sliding_window=4096)) == [4096] * 3
    qwen = dict(base, sliding_window=64, max_window_layers=2)
    assert qwen2(qwen) == qwen3(qwen) == [None] * 3  # use_sliding_window defaults to off
    assert qwen2(dict(qwen, use_sliding_window=True)) == [None, None, 64]
    assert qwen3(dict(qwen, use_sliding_window=True)) == [None, None, 64]
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    assert llama(dict(base, sliding_window=32, layer_types=types)) == [32, None, 32]
    with pytest.raises(ValueError, match="layer_types"):
        llama(dict(base, sliding_window=32, layer_types=types[:2]))
