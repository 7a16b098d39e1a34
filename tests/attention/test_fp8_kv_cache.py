"""The FP8 KV cache end to end: checkpoint K/V scales, and an engine on a tiny checkpoint
(chunked prefill, prefix caching) against the same engine with a float32 / bfloat16 cache."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from peregrine.attention import get_attention_backend
from peregrine.attention.kv_scales import take_kv_scales
from peregrine.layers.attention import Attention

PROMPTS = [list(range(10, 70)), list(range(100, 160, 2)) * 2]  # 60 tokens each


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for layer in self.layers:
            layer.self_attn = nn.Module()
            layer.self_attn.attn = Attention(4, 2, 16, 0.25, get_attention_backend("torch"))


@pytest.mark.parametrize("k_name, v_name", [
    ("self_attn.k_scale", "self_attn.v_scale"),
    ("self_attn.attn.k_scale", "self_attn.attn.v_scale"),
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
    ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
])
def test_kv_scales_are_read_in_each_spelling(k_name: str, v_name: str) -> None:
    model = _TwoLayers()
    other = ("model.layers.0.self_attn.o_proj.weight", torch.ones(2))
    weights = [other,
               (f"model.layers.1.{k_name}", torch.tensor(0.25)),
               (f"model.layers.1.{v_name}", torch.tensor([0.5], dtype=torch.bfloat16)),
               ("model.layers.0.self_attn.q_scale", torch.tensor(3.0))]  # dropped: q stays 16-bit
    rest = list(take_kv_scales(model, weights))
    assert rest == [other]
    assert (model.layers[1].self_attn.attn.k_scale, model.layers[1].self_attn.attn.v_scale) == (
        0.25, 0.5)
    assert (model.layers[0].self_attn.attn.k_scale, model.layers[0].self_attn.attn.v_scale) == (
        1.0, 1.0)


def test_kv_scale_sets_both_and_bad_scales_are_refused() -> None:
    model = _TwoLayers()
    list(take_kv_scales(model, [("model.layers.0.self_attn.kv_scale", torch.tensor(0.125))]))
    attn = model.layers[0].self_attn.attn
    assert (attn.k_scale, attn.v_scale) == (0.125, 0.125)
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.k_scale'.*one value"):
        list(take_kv_scales(model, [("model.layers.1.self_attn.k_scale", torch.ones(2))]))
    with pytest.raises(ValueError, match=r"v_scale must be finite and > 0.*layers.1.self_attn"):
        list(take_kv_scales(model, [("model.layers.1.self_attn.v_scale", torch.tensor(-1.0))]))


def _prompt_logprobs(model: str, kv_cache_dtype: str) -> torch.Tensor:
    """Teacher-forced logprobs of every prompt token after the first, prompts chunked by 32."""
    from peregrine import LLM, SamplingParams
    llm = LLM(model, dtype="float32", device="cpu", max_model_len=256,
              kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return torch.tensor([next(iter(p.values())).logprob for o in outs
                         for p in o.prompt_logprobs[1:]])


@pytest.mark.slow  # three engines, prompt logprobs: ~20 s on two cores
def test_fp8_cache_logprobs_track_the_float32_cache() -> None:
    """The error of a rounded cache grows with its unit roundoff: e4m3's 2^-4 is 16x bfloat16's
    2^-8, so the FP8 cache's logprobs may be off by up to 2 x 16 x what a bfloat16 cache costs
    on the same prompts (measured: ~14x); a prefill in 32-token chunks reads its earlier chunks
    back from the cache."""
    from peregrine.testing.checkpoints import tiny_checkpoint
    model = str(tiny_checkpoint("qwen3"))
    exact = _prompt_logprobs(model, "float32")
    bf16 = (_prompt_logprobs(model, "bfloat16") - exact).abs()
    fp8 = (_prompt_logprobs(model, "fp8") - exact).abs()
    assert 0 < bf16.mean() and 0 < fp8.mean()
    assert fp8.mean() <= 32 * bf16.mean(), (fp8.mean(), bf16.mean())
    assert fp8.max() <= 32 * bf16.max(), (fp8.max(), bf16.max())


@pytest.fixture(scope="module")
def scaled_checkpoint(tmp_path_factory) -> Path:
    """The tiny qwen3 checkpoint plus a shard of K/V scales in two spellings."""
    from peregrine.testing.checkpoints import tiny_checkpoint
    out = tmp_path_factory.mktemp("fp8-scales") / "qwen3"
    shutil.copytree(tiny_checkpoint("qwen3"), out)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(1 / 16),
               "model.layers.0.self_attn.v_scale": torch.tensor(1 / 32),
               "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([1 / 8]),
               "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([1 / 64])},
              str(out / "kv_scales.safetensors"))
    return out


def test_engine_reads_checkpoint_scales_and_stores_scaled_values(scaled_checkpoint) -> None:
    from peregrine import LLM, SamplingParams
    llm = LLM(str(scaled_checkpoint), dtype="float32", device="cpu", max_model_len=256,
              kv_cache_dtype="fp8", max_num_batched_tokens=32)
    worker = llm.engine.core_client.core.executor.worker
    attns = [layer.self_attn.attn for layer in worker.model.layers]
    assert [(a.k_scale, a.v_scale) for a in attns] == [(1 / 16, 1 / 32), (1 / 8, 1 / 64)]
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    # |k| and |v| of this model stay below ~9, so only values divided by the scales reach 20+.
    for attn, (k_cache, v_cache) in zip(attns, worker.model_runner.kv_caches):
        assert k_cache.dtype == torch.float8_e4m3fn
        assert 20 < k_cache.float().abs().max() <= 448
        assert 20 < v_cache.float().abs().max() <= 448


def test_prefix_cached_fp8_blocks_give_what_recomputing_them_gives(scaled_checkpoint) -> None:
    from peregrine import LLM, SamplingParams
    shared = PROMPTS[0][:48]  # three full blocks
    first, second = shared + [5, 6, 7], shared + [300, 301, 302, 303]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)

    def engine():
        return LLM(str(scaled_checkpoint), dtype="float32", device="cpu", max_model_len=256,
                   kv_cache_dtype="fp8", max_num_batched_tokens=32, enable_prefix_caching=True)

    warm = engine()
    warm.generate([first], params, use_tqdm=False)
    hit = warm.generate([second], params, use_tqdm=False)[0]
    fresh = engine().generate([second], params, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 48 and fresh.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == fresh.outputs[0].token_ids
    got = [next(iter(p.values())).logprob for p in hit.outputs[0].logprobs]
    want = [next(iter(p.values())).logprob for p in fresh.outputs[0].logprobs]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
