"""Checkpoints written by the quantizers themselves, committed under tests/fixtures (each
folder's make_fixtures.py and versions.json say how and with what): llm-compressor's
compressed-tensors checkpoints, read as the compressed-tensors library decompresses them, with
the KV-cache scales it calibrated; AutoAWQ's, read as AutoAWQ unpacks it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from peregrine.testing import fp8_pack
from peregrine.testing.steps import prefill_logits

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llm_compressor"
AWQ = Path(__file__).resolve().parents[1] / "fixtures" / "autoawq" / "llama-awq-g32"
VOCAB = 128  # the llm-compressor fixtures' tiny vocabulary
TOKENS = [5, 17, 99, 23, 41, 8, 77, 101, 12, 64, 120, 9]
PREFIX = [(7 * i + 3) % (VOCAB - 4) + 4 for i in range(40)]
PROMPTS = [PREFIX + [11, 12, 13], PREFIX + [100, 101, 102, 103, 104]]


def _dense_twin(case: Path, dst: Path) -> Path:
    """The fixture's model with the weights its quantizer's library decompressed (<case>.dense.
    safetensors) in place of its quantized modules, as a plain checkpoint at dst."""
    config = json.loads((case / "config.json").read_text())
    del config["quantization_config"]
    dense = load_file(str(case.parent / f"{case.name}.dense.safetensors"))
    modules = {name[:-len(".weight")] for name in dense}
    plain = {n: t for n, t in load_file(str(case / "model.safetensors")).items()
             if n.rsplit(".", 1)[0] not in modules and not n.endswith((".k_scale", ".v_scale"))}
    dst.mkdir(parents=True)
    save_file({**plain, **dense}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _scheme(case: Path) -> dict:
    return json.loads((case / "config.json").read_text())["quantization_config"]


WEIGHT_ONLY = ["llama/w4a16-asym-g32", "llama/w4a16-sym-channel", "llama/w8a16-sym-g32",
               "llama/w4a16-gptq-g32", "qwen3/w4a16-asym-g32"]


@pytest.mark.parametrize("name", WEIGHT_ONLY + ["autoawq"])
def test_weight_only_checkpoint_gives_the_decompressed_models_logits(tmp_path: Path,
                                                                     name: str) -> None:
    case = AWQ if name == "autoawq" else FIXTURES / name
    scheme = _scheme(case)
    if name == "autoawq":
        assert (scheme["quant_method"], scheme["version"]) == ("awq", "gemm")
    else:
        assert (scheme["quant_method"], scheme["format"]) == ("compressed-tensors",
                                                              "pack-quantized")
    got = prefill_logits(str(case), TOKENS)
    want = prefill_logits(str(_dense_twin(case, tmp_path / "dense")), TOKENS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama/w4a16-asym-g32", "autoawq"])
def test_weight_only_checkpoint_generates_transformers_greedy_tokens(tmp_path: Path,
                                                                     name: str) -> None:
    """Through the engine (prefix caching, chunked prefill): greedy tokens equal transformers'
    on the decompressed model, float32."""
    from transformers import AutoModelForCausalLM

    from peregrine import LLM, SamplingParams
    case = AWQ if name == "autoawq" else FIXTURES / name
    dense = _dense_twin(case, tmp_path / "dense")
    llm = LLM(str(case), dtype="float32", device="cpu", skip_tokenizer_init=True,
              max_model_len=128, enable_prefix_caching=True, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in PROMPTS:
            out = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                              min_new_tokens=8, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    assert got == want


@pytest.mark.parametrize("name, act_dtype, group", [
    ("llama/int8-w8a8", torch.int8, None),
    ("llama/fp8-dynamic-kv", fp8_pack.FP8_DTYPE, None),
    ("llama/fp8-block32", fp8_pack.FP8_DTYPE, 32),  # 32 x 32 weight blocks, inputs per 32
])
def test_w8a8_checkpoint_matches_the_decompressed_model_with_rounded_inputs(
        tmp_path: Path, name: str, act_dtype: torch.dtype, group: int | None) -> None:
    """Weights as decompressed; each linear layer's input rounded per token (or per group of
    inputs) like the scheme's dynamic activations (the reference twin's hooks): the same
    logprobs within float32 noise."""
    case = FIXTURES / name
    inputs = _scheme(case)["config_groups"]["group_0"]["input_activations"]
    assert inputs["dynamic"] and inputs["group_size"] == group
    scores = fp8_pack.score_generation(case, _dense_twin(case, tmp_path / "dense"), act_dtype,
                                       group, prompts=PROMPTS)
    got = torch.tensor(scores["quantized"])
    torch.testing.assert_close(got, torch.tensor(scores["reference_rounded"]), rtol=0,
                               atol=1e-4)
    assert (got - torch.tensor(scores["reference"])).abs().max() > 1e-5  # inputs were rounded


_MERGED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _static_input_scales(case: Path) -> dict[str, float]:
    """Each of the engine's linear layers' per-tensor input scale, by module name: the largest
    of its merged projections' calibrated scales."""
    scales: dict[str, float] = {}
    with safe_open(str(case / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if name.endswith(".input_scale"):
                parts = name[len("model."):-len(".input_scale")].split(".")
                parts[-1] = _MERGED.get(parts[-1], parts[-1])
                key = ".".join(parts)
                scales[key] = max(scales.get(key, 0.0), float(f.get_tensor(name).reshape(())))
    return scales


def test_smoothquant_checkpoint_matches_the_decompressed_model_up_to_a_rounding_flip(
        tmp_path: Path) -> None:
    """SmoothQuant folded into the RMSNorm weights, then INT8 W8A8: the same comparison as
    above, except that one int8 rounding may land the other way (the engine's integer matmul
    and the reference's float one differ in the last float32 bit, and on these prompts one
    attention output element sits on a rounding boundary; one step there moves that position's
    logprob by ~0.2). Every other position agrees within float32 noise, and all stay within
    int8 rounding's reach of the unrounded model."""
    case = FIXTURES / "llama" / "smoothquant-int8-w8a8"
    dense = _dense_twin(case, tmp_path / "dense")
    norm = "model.layers.0.input_layernorm.weight"
    plain = load_file(str(FIXTURES / "llama" / "int8-w8a8" / "model.safetensors"))[norm]
    assert (load_file(str(dense / "model.safetensors"))[norm] - plain).abs().max() > 0.1
    scores = fp8_pack.score_generation(case, dense, torch.int8, prompts=PROMPTS)
    got = torch.tensor(scores["quantized"])
    close = (got - torch.tensor(scores["reference_rounded"])).abs() <= 1e-4
    assert int(close.sum()) >= len(got) - 1, scores
    assert (got - torch.tensor(scores["reference"])).abs().max() < 1.0


def test_static_fp8_checkpoint_matches_the_decompressed_model_with_inputs_rounded_by_its_scales(
        tmp_path: Path) -> None:
    """llm-compressor's FP8 scheme: per-tensor weight scales and calibrated per-tensor input
    scales (q, k and v share theirs: one input). Each layer's input rounded to FP8 with its
    scale on the decompressed model gives the checkpoint's logprobs within float32 noise."""
    case = FIXTURES / "llama" / "fp8-static"
    inputs = _scheme(case)["config_groups"]["group_0"]["input_activations"]
    assert not inputs["dynamic"] and inputs["strategy"] == "tensor"
    static = _static_input_scales(case)
    assert len(static) == 8 and all(0 < s < 1 for s in static.values())
    scores = fp8_pack.score_generation(case, _dense_twin(case, tmp_path / "dense"),
                                       fp8_pack.FP8_DTYPE, prompts=PROMPTS, static=static)
    got = torch.tensor(scores["quantized"])
    torch.testing.assert_close(got, torch.tensor(scores["reference_rounded"]), rtol=0,
                               atol=1e-4)
    assert (got - torch.tensor(scores["reference"])).abs().max() > 1e-5  # inputs were rounded


def _stored_kv_scales(case: Path) -> list[tuple[float, float]]:
    with safe_open(str(case / "model.safetensors"), "pt") as f:
        layers = sorted({int(n.split(".")[2]) for n in f.keys() if n.endswith(".k_scale")})
        return [tuple(float(f.get_tensor(f"model.layers.{i}.self_attn.{w}_scale").reshape(()))
                      for w in ("k", "v")) for i in layers]


def test_calibrated_kv_cache_scales_are_read_and_applied() -> None:
    from peregrine import LLM, SamplingParams
    case = FIXTURES / "llama" / "fp8-dynamic-kv"
    assert _scheme(case)["kv_cache_scheme"]["type"] == "float"
    stored = _stored_kv_scales(case)
    assert len(stored) == 2 and all(0 < s < 0.1 for pair in stored for s in pair)
    llm = LLM(str(case), dtype="float32", device="cpu", skip_tokenizer_init=True,
              max_model_len=128, kv_cache_dtype="fp8", max_num_batched_tokens=16)
    worker = llm.engine.core_client.core.executor.worker
    attns = [layer.self_attn.attn for layer in worker.model.layers]
    assert [(a.k_scale, a.v_scale) for a in attns] == stored
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    # The scales were calibrated as amax / 448 over token rows like these, so the cache holds
    # values near e4m3's top (448) that unscaled K and V (|x| < ~10) would never reach.
    for k_cache, v_cache in worker.model_runner.kv_caches:
        assert k_cache.dtype == torch.float8_e4m3fn
        assert 100 < k_cache.float().abs().max() <= 448
        assert 100 < v_cache.float().abs().max() <= 448
