"""KV cache element types and K/V scales: both backends store and read them back."""
from __future__ import annotations

import pytest
import torch

from peregrine.attention import get_attention_backend
from step_cases import make_step, naive_attention

SCALE = 0.125
MIXED = dict(prefix_lens=[0, 30, 21, 0], q_lens=[1, 1, 13, 9])
BACKENDS = ["torch", "triton"]


def _with_cache_dtype(step, dtype: torch.dtype):
    step.k_cache, step.v_cache = step.k_cache.to(dtype), step.v_cache.to(dtype)
    return step


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.bfloat16, torch.float32),
                                                  (torch.float32, torch.bfloat16),
                                                  (torch.float32, torch.float16)])
def test_cache_dtype_other_than_the_model_dtype(backend: str, q_dtype: torch.dtype,
                                                cache_dtype: torch.dtype) -> None:
    step = _with_cache_dtype(make_step(**MIXED, dtype=q_dtype), cache_dtype)
    out = get_attention_backend(backend).forward(step.q, step.k, step.v, step.k_cache,
                                                 step.v_cache, step.meta, SCALE)
    assert out.dtype == q_dtype and step.k_cache.dtype == cache_dtype
    # NOTE: the oracle sees the K/V as the cache rounds them.
    step.dense_k = [k.to(cache_dtype) for k in step.dense_k]
    step.dense_v = [v.to(cache_dtype) for v in step.dense_v]
    torch.testing.assert_close(out.float(), naive_attention(step, SCALE), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_scales_store_scaled_values_and_read_them_back(backend: str) -> None:
    step = make_step(**MIXED)
    # NOTE: the cached prefixes are stored scaled like the new tokens; powers of two keep
    # dividing and multiplying back exact.
    step.k_cache /= 2.0
    step.v_cache /= 0.5
    out = get_attention_backend(backend).forward(step.q, step.k, step.v, step.k_cache,
                                                 step.v_cache, step.meta, SCALE,
                                                 k_scale=2.0, v_scale=0.5)
    slots = step.meta.slot_mapping
    stored_k = step.k_cache.flatten(0, 1)[slots]  # (T, Hkv, D)
    stored_v = step.v_cache.flatten(0, 1)[slots]  # (T, Hkv, D)
    assert torch.equal(stored_k, step.k / 2.0) and torch.equal(stored_v, step.v / 0.5)
    torch.testing.assert_close(out, naive_attention(step, SCALE), atol=1e-5, rtol=1e-5)


def test_kv_scale_of_attention_layer_reaches_the_backend() -> None:
    from peregrine.layers.attention import Attention
    step = make_step(**MIXED)
    step.k_cache /= 4.0
    step.v_cache /= 2.0
    attn = Attention(4, 2, 64, SCALE, get_attention_backend("torch"), k_scale=4.0, v_scale=2.0)
    out = attn(step.q, step.k, step.v, (step.k_cache, step.v_cache), step.meta)  # (T, Hq * D)
    torch.testing.assert_close(out.view_as(step.q), naive_attention(step, SCALE),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(step.k_cache.flatten(0, 1)[step.meta.slot_mapping], step.k / 4.0)
    with pytest.raises(ValueError, match="k_scale"):
        Attention(4, 2, 64, SCALE, get_attention_backend("torch"), k_scale=0.0)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_is_refused_clearly(name: str) -> None:
    from peregrine.config import EngineArgs
    from peregrine.testing.checkpoints import tiny_checkpoint
    with pytest.raises(ValueError, match="FP8 KV cache is not available in this version"):
        EngineArgs(model=str(tiny_checkpoint("llama")), kv_cache_dtype=name).create_engine_config()


def test_unknown_kv_cache_dtype_lists_the_choices() -> None:
    from peregrine.config import EngineArgs
    from peregrine.testing.checkpoints import tiny_checkpoint
    with pytest.raises(ValueError, match=r"'int8'.*auto.*bfloat16"):
        EngineArgs(model=str(tiny_checkpoint("llama")),
                   kv_cache_dtype="int8").create_engine_config()


@pytest.mark.parametrize("name, want", [("auto", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                        ("float16", torch.float16), ("float32", torch.float32)])
def test_kv_cache_dtype_resolves_and_sizes_blocks(name: str, want: torch.dtype) -> None:
    from peregrine.attention.kv_dtype import kv_cache_bytes_per_block, kv_cache_torch_dtype
    from peregrine.config import EngineArgs
    from peregrine.testing.checkpoints import tiny_checkpoint
    cfg = EngineArgs(model=str(tiny_checkpoint("llama")), dtype="bfloat16", block_size=16,
                     kv_cache_dtype=name).create_engine_config()
    assert cfg.cache.cache_dtype == name
    assert kv_cache_torch_dtype(cfg.cache, cfg.model) == want
    mc = cfg.model
    elem = torch.empty((), dtype=want).element_size()
    assert kv_cache_bytes_per_block(cfg.cache, mc) == (
        2 * mc.num_layers * 16 * mc.num_kv_heads * mc.head_dim * elem)


def test_engine_allocates_and_runs_the_requested_kv_cache_dtype() -> None:
    """The pool is allocated in the requested dtype (a float32 model with a bfloat16 cache runs);
    float32 named explicitly equals auto for a float32 model."""
    from peregrine import LLM, SamplingParams
    from peregrine.testing.checkpoints import tiny_checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[11, 42, 97, 130, 7, 300], [5, 17, 99]]
    outs = {}
    for name in ("auto", "float32", "bfloat16"):
        llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", device="cpu", max_model_len=64,
                  kv_cache_dtype=name)
        worker = llm.engine.core_client.core.executor.worker
        want = torch.bfloat16 if name == "bfloat16" else torch.float32
        assert {c.dtype for kv in worker.model_runner.kv_caches for c in kv} == {want}
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["float32"] == outs["auto"]
    assert [len(t) for t in outs["bfloat16"]] == [8, 8]
