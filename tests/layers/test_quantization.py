"""Quantization methods plug in through the registry: their own parameters, loaders (packed and
tensor-parallel sharded tensors) and matmuls give the logits of the equivalent unquantized model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import fake_methods  # noqa: F401  (registers fake_transposed and fake_int4)
from peregrine.config import EngineArgs
from peregrine.layers.quantization import (UnquantizedLinearMethod, quantization_methods,
                                           resolve_quantization)
from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.testing.gloo import run_on_gloo_ranks
from peregrine.testing.steps import prefill_logits

TOKENS = [5, 17, 99, 230, 41, 8, 77, 301, 12, 64, 150, 9]
WORLD = 2


def _logits(path: str, **engine_args) -> torch.Tensor:
    """Logits of one prefill through the torch backend (tensor-parallel when a group is set)."""
    return prefill_logits(path, TOKENS, **engine_args)


def _quantized(tmp_path: Path, arch: str, method: str, skip: tuple[str, ...] = ()) -> Path:
    return fake_methods.write_quantized(tiny_checkpoint(arch), tmp_path / f"{arch}-{method}",
                                        method, skip)


def _methods_for(path: Path, **engine_args) -> dict[str, str]:
    from peregrine.attention import get_attention_backend
    from peregrine.layers.linear import LinearBase
    from peregrine.worker.loader import load_model
    cfg = EngineArgs(model=str(path), device="cpu", **engine_args).create_engine_config().model
    model = load_model(cfg, get_attention_backend("torch"), torch.device("cpu"))
    return {n: type(m.quant_method).__name__ for n, m in model.named_modules()
            if isinstance(m, LinearBase)}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_transposed_method_gives_the_unquantized_logits(tmp_path: Path, arch: str) -> None:
    path = _quantized(tmp_path, arch, "fake_transposed")
    torch.testing.assert_close(_logits(str(path)), _logits(str(tiny_checkpoint(arch))),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_int4_gives_the_dequantized_models_logits(tmp_path: Path, arch: str) -> None:
    path = _quantized(tmp_path, arch, "fake_int4")
    reference = path.parent / f"{path.name}-reference"
    got = _logits(str(path))
    torch.testing.assert_close(got, _logits(str(reference)), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, _logits(str(tiny_checkpoint(arch))), atol=1e-3)  # int4 did round


def test_skipped_modules_stay_unquantized(tmp_path: Path) -> None:
    path = _quantized(tmp_path, "llama", "fake_int4", skip=("mlp.down_proj",))
    methods = _methods_for(path)
    assert methods["layers.0.mlp.down_proj"] == UnquantizedLinearMethod.__name__
    assert methods["layers.0.mlp.gate_up_proj"] == "Int4Method"
    assert methods["layers.1.self_attn.qkv_proj"] == "Int4Method"
    reference = path.parent / f"{path.name}-reference"
    torch.testing.assert_close(_logits(str(path)), _logits(str(reference)), rtol=1e-6, atol=1e-6)


def test_a_fused_layer_is_skipped_whole_or_not_at_all(tmp_path: Path) -> None:
    path = _quantized(tmp_path, "llama", "fake_transposed", skip=("self_attn.k_proj",))
    with pytest.raises(ValueError, match="partly skipped"):
        _methods_for(path)


def test_unknown_method_is_named_with_the_known_ones(tmp_path: Path) -> None:
    path = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("llama"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "no_such_method"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'no_such_method'.*fake_int4, fake_transposed"):
        EngineArgs(model=str(path)).create_engine_config()
    with pytest.raises(ValueError, match="'also_unknown'"):
        EngineArgs(model=str(tiny_checkpoint("llama")),
                   quantization="also_unknown").create_engine_config()


def test_requested_method_must_agree_with_the_checkpoint(tmp_path: Path) -> None:
    path = _quantized(tmp_path, "llama", "fake_transposed")
    cfg = EngineArgs(model=str(path), quantization="fake_transposed").create_engine_config()
    assert cfg.model.quantization.name == "fake_transposed"
    with pytest.raises(ValueError, match="disagrees with the checkpoint"):
        EngineArgs(model=str(path), quantization="fake_int4").create_engine_config()
    plain = EngineArgs(model=str(tiny_checkpoint("llama"))).create_engine_config()
    assert plain.model.quantization is None
    assert {"fake_int4", "fake_transposed"} <= set(quantization_methods())


def test_a_kernel_name_asks_for_its_checkpoint_format() -> None:
    """`--quantization awq_marlin` / `gptq_marlin`, as commands written for vLLM pass them."""
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
           "version": "gemm"}
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
            "desc_act": False}
    assert resolve_quantization({"quantization_config": awq}, "awq_marlin").name == "awq"
    assert resolve_quantization({"quantization_config": gptq}, "gptq_marlin").name == "gptq"
    with pytest.raises(ValueError, match="'gptq' disagrees with the checkpoint.*'awq'"):
        resolve_quantization({"quantization_config": awq}, "gptq_marlin")
    with pytest.raises(ValueError, match="not AWQ-quantized"):
        resolve_quantization({}, "awq_marlin")
    assert "awq_marlin" not in quantization_methods()


def test_requested_method_on_a_plain_checkpoint_is_applied(tmp_path: Path) -> None:
    path = tiny_checkpoint("llama")
    assert set(_methods_for(path, quantization="fake_transposed").values()) == {"TransposedMethod"}
    torch.testing.assert_close(_logits(str(path), quantization="fake_transposed"),
                               _logits(str(path)), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_int4_splits_over_two_ranks(tmp_path: Path, arch: str) -> None:
    """Column layers split their output-packed qweight, row layers their input-packed one."""
    path = str(_quantized(tmp_path, arch, "fake_int4"))
    want = _logits(path)
    torch.testing.assert_close(run_on_gloo_ranks(_logits, WORLD, path), want, rtol=1e-4, atol=1e-4)
