"""KV cache element types and K/V scales: both backends store and read them back."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from peregrine.attention import get_attention_backend
from peregrine.kernels.reference import dequantize_kv_ref, quantize_kv_ref
from step_cases import TOLERANCES, make_step, naive_attention

sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
from kernel_cases import fp8_error_bounds  # noqa: E402

SCALE = 0.125
MIXED = dict(prefix_lens=[0, 30, 21, 0], q_lens=[1, 1, 13, 9])
BACKENDS = ["torch", "triton"]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]


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


def _fp8_step(cache_dtype: torch.dtype, k_scale: float, v_scale: float, **kw):
    """A mixed step whose cached prefixes are stored in FP8 as k / k_scale, v / v_scale; the
    dense K/V the oracle sees are the dequantized ones."""
    step = make_step(**{**MIXED, **kw})
    step.k_cache = quantize_kv_ref(step.k_cache, cache_dtype, k_scale)
    step.v_cache = quantize_kv_ref(step.v_cache, cache_dtype, v_scale)
    step.exact_k, step.exact_v = step.dense_k, step.dense_v
    step.dense_k = [dequantize_kv_ref(quantize_kv_ref(k, cache_dtype, k_scale), k_scale)
                    for k in step.dense_k]
    step.dense_v = [dequantize_kv_ref(quantize_kv_ref(v, cache_dtype, v_scale), v_scale)
                    for v in step.dense_v]
    return step


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
def test_fp8_cache_stores_quantized_and_attends_on_the_dequantized_values(
        backend: str, cache_dtype: torch.dtype) -> None:
    k_scale, v_scale = 0.37, 0.11
    step = _fp8_step(cache_dtype, k_scale, v_scale)
    out = get_attention_backend(backend).forward(step.q, step.k, step.v, step.k_cache,
                                                 step.v_cache, step.meta, SCALE,
                                                 k_scale=k_scale, v_scale=v_scale)
    slots = step.meta.slot_mapping
    for cache, x, scale in ((step.k_cache, step.k, k_scale), (step.v_cache, step.v, v_scale)):
        stored = cache.flatten(0, 1)[slots]  # (T, Hkv, D)
        want = quantize_kv_ref(x, cache_dtype, scale)
        assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8))
    # Exactly attention on the dequantized cache (fp32 tolerance) ...
    torch.testing.assert_close(out, naive_attention(step, SCALE), atol=1e-5, rtol=1e-5)
    # ... and close to attention on the unrounded K/V, within the FP8 rounding's bound.
    step.dense_k, step.dense_v = step.exact_k, step.exact_v
    max_err, mean_err = fp8_error_bounds(cache_dtype, torch.cat(step.exact_v))
    err = (out - naive_attention(step, SCALE)).abs()
    assert err.max().item() <= max_err and err.mean().item() <= mean_err, (err.max(), err.mean())


def test_fp8_cache_triton_backend_equals_torch_backend_in_bf16() -> None:
    outs = []
    for backend in BACKENDS:
        step = _fp8_step(torch.float8_e4m3fn, 0.5, 0.25, dtype=torch.bfloat16)
        outs.append(get_attention_backend(backend).forward(
            step.q, step.k, step.v, step.k_cache, step.v_cache, step.meta, SCALE,
            k_scale=0.5, v_scale=0.25))
        assert outs[-1].dtype == torch.bfloat16
    torch.testing.assert_close(outs[1].float(), outs[0].float(), **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_attention_layer_applies_its_scales_to_an_fp8_cache_only(cache_dtype) -> None:
    from peregrine.layers.attention import Attention
    k_scale, v_scale = 4.0, 2.0
    fp8 = cache_dtype == torch.float8_e4m3fn
    step = _fp8_step(cache_dtype, k_scale, v_scale) if fp8 else make_step(**MIXED)
    attn = Attention(4, 2, 64, SCALE, get_attention_backend("torch"), k_scale=k_scale,
                     v_scale=v_scale)
    out = attn(step.q, step.k, step.v, (step.k_cache, step.v_cache), step.meta)  # (T, Hq * D)
    torch.testing.assert_close(out.view_as(step.q), naive_attention(step, SCALE),
                               atol=1e-5, rtol=1e-5)
    stored = step.k_cache.flatten(0, 1)[step.meta.slot_mapping]  # (T, Hkv, D)
    want = quantize_kv_ref(step.k, cache_dtype, k_scale) if fp8 else step.k
    assert torch.equal(stored.float(), want.float())


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_attention_layer_refuses_bad_scales(bad: float) -> None:
    from peregrine.layers.attention import Attention
    with pytest.raises(ValueError, match="k_scale must be finite and > 0"):
        Attention(4, 2, 64, SCALE, get_attention_backend("torch"), k_scale=bad)
    attn = Attention(4, 2, 64, SCALE, get_attention_backend("torch"))
    with pytest.raises(ValueError, match=r"v_scale .*'layers.3.self_attn.v_scale'"):
        attn.set_kv_scale("v", bad, source="checkpoint tensor 'layers.3.self_attn.v_scale'")


def test_unknown_kv_cache_dtype_lists_the_choices() -> None:
    from peregrine.config import EngineArgs
    from peregrine.testing.checkpoints import tiny_checkpoint
    with pytest.raises(ValueError, match=r"'int8'.*auto.*bfloat16"):
        EngineArgs(model=str(tiny_checkpoint("llama")),
                   kv_cache_dtype="int8").create_engine_config()


@pytest.mark.parametrize("name, want", [("auto", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                        ("float16", torch.float16), ("float32", torch.float32),
                                        ("fp8", torch.float8_e4m3fn),
                                        ("fp8_e4m3", torch.float8_e4m3fn),
                                        ("fp8_e5m2", torch.float8_e5m2)])
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
    assert elem == (1 if name.startswith("fp8") else 2 if want != torch.float32 else 4)


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
