"""compressed-tensors configs (as llm-compressor writes them): scheme dispatch, targets and
ignore lists, refusals by name, the weight-only hand-off, and W8A8 FP8 checkpoints end to end."""
from __future__ import annotations

import copy
import sys
import types
from pathlib import Path

import pytest
import torch

from peregrine.kernels.fp8_quant import FP8_DTYPE
from peregrine.layers.quantization.compressed_tensors import CompressedTensorsConfig
from peregrine.layers.quantization.fp8 import Fp8BlockMethod, Fp8W8A8Method
from peregrine.layers.quantization.int8 import Int8W8A8Method
from peregrine.layers.quantization.unquantized import UnquantizedLinearMethod
from peregrine.testing import fp8_pack
from peregrine.testing.checkpoints import tiny_checkpoint

QKV = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
       "model.layers.0.self_attn.v_proj"]
DOWN = ["model.layers.3.mlp.down_proj"]


def _cfg(scheme: str = "fp8_dynamic", **changes) -> dict:
    cfg = fp8_pack.compressed_tensors_config(scheme)
    cfg.update(changes)
    return cfg


def _method(cfg: dict, prefixes: list[str] = DOWN):
    return CompressedTensorsConfig.from_config(cfg).get_quant_method(prefixes)


@pytest.mark.parametrize("scheme, cls, static", [
    ("fp8_dynamic", Fp8W8A8Method, False), ("fp8_static", Fp8W8A8Method, True),
    ("int8_dynamic", Int8W8A8Method, False), ("int8_static", Int8W8A8Method, True),
])
def test_w8a8_schemes_pick_their_method(scheme: str, cls: type, static: bool) -> None:
    method = _method(_cfg(scheme))
    assert type(method) is cls and method.static_input is static
    assert method.weight_strategy == "channel"


def test_block_scheme_reads_weight_scale_blocks() -> None:
    method = _method(_cfg("fp8_block"))
    assert isinstance(method, Fp8BlockMethod)
    assert method.block == (128, 128) and method.scale_name == "weight_scale"


def test_ignore_names_and_regexes_leave_modules_unquantized() -> None:
    cfg = CompressedTensorsConfig.from_config(
        _cfg(ignore=["lm_head", "re:.*layers\\.3\\.mlp\\..*", "model.layers.0.self_attn.q_proj",
                     "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]))
    assert cfg.get_quant_method(DOWN) is None
    assert cfg.get_quant_method(QKV) is None
    assert isinstance(cfg.get_quant_method(["model.layers.2.mlp.down_proj"]), Fp8W8A8Method)


def test_a_named_target_beats_the_linear_class() -> None:
    cfg = _cfg()
    cfg["config_groups"]["group_1"] = copy.deepcopy(
        fp8_pack.compressed_tensors_config("int8_dynamic")["config_groups"]["group_0"])
    cfg["config_groups"]["group_1"]["targets"] = ["re:.*down_proj$"]
    cfg["format"] = "mixed-precision"
    config = CompressedTensorsConfig.from_config(cfg)
    assert isinstance(config.get_quant_method(DOWN), Int8W8A8Method)
    assert isinstance(config.get_quant_method(QKV), Fp8W8A8Method)


def test_modules_no_group_targets_stay_unquantized() -> None:
    cfg = _cfg()
    cfg["config_groups"]["group_0"]["targets"] = ["re:.*mlp.*"]
    assert isinstance(_method(cfg, QKV), UnquantizedLinearMethod)
    assert isinstance(_method(cfg, DOWN), Fp8W8A8Method)


def test_kv_cache_scheme_is_accepted() -> None:
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
          "symmetric": True}
    config = CompressedTensorsConfig.from_config(_cfg(kv_cache_scheme=kv))
    assert config.kv_cache_scheme == kv


def _scheme(cfg: dict) -> dict:
    return cfg["config_groups"]["group_0"]


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(format="marlin-24"), "format 'marlin-24'"),
    (lambda c: _scheme(c).update(format="nvfp4-pack-quantized"), "nvfp4-pack-quantized"),
    (lambda c: _scheme(c)["input_activations"].update(symmetric=False),
     "asymmetric activations"),
    (lambda c: _scheme(c)["weights"].update(symmetric=False), "asymmetric weights"),
    (lambda c: _scheme(c)["weights"].update(strategy="group", group_size=128),
     "weight strategy 'group'"),
    (lambda c: _scheme(c)["input_activations"].update(strategy="token", dynamic=False),
     "activation strategy 'token' with dynamic=False"),
    (lambda c: _scheme(c).update(input_activations=None), "weight-only int8 in format .int-quantized."),
    (lambda c: _scheme(c)["input_activations"].update(num_bits=4), "only W8A8"),
    (lambda c: _scheme(c).update(output_activations={"num_bits": 8}), "output activation"),
    (lambda c: c.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity format"),
    (lambda c: c.update(transform_config={"hadamard": {}}), "transform_config"),
    (lambda c: c.update(config_groups={}), "no config_groups"),
])
def test_unsupported_schemes_are_refused_by_name(edit, match: str) -> None:
    cfg = _cfg("int8_dynamic")
    edit(cfg)
    with pytest.raises(ValueError, match=match):
        CompressedTensorsConfig.from_config(cfg)


def test_int_weights_in_float_format_are_refused() -> None:
    cfg = _cfg("int8_dynamic")
    _scheme(cfg)["format"] = "float-quantized"
    with pytest.raises(ValueError, match="int weights cannot be read in format 'float-quantized'"):
        CompressedTensorsConfig.from_config(cfg)


def test_online_compressed_tensors_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot quantize a model at load"):
        CompressedTensorsConfig.from_config({})


def _wna16_cfg() -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128,
               "strategy": "group", "dynamic": False, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}},
            "ignore": ["lm_head"]}


def test_pack_quantized_weight_only_goes_to_the_wna16_method(monkeypatch) -> None:
    seen = []

    class StandIn(UnquantizedLinearMethod):
        def __init__(self, weights: dict) -> None:
            seen.append(weights)

    module = types.ModuleType("peregrine.layers.quantization.compressed_tensors_wna16")
    module.CompressedTensorsWNA16Method = StandIn
    monkeypatch.setitem(sys.modules, module.__name__, module)
    method = _method(_wna16_cfg())
    assert isinstance(method, StandIn)
    assert seen[-1]["num_bits"] == 4 and seen[-1]["group_size"] == 128


def test_pack_quantized_with_activations_is_refused() -> None:
    cfg = _wna16_cfg()
    _scheme(cfg)["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token",
                                         "dynamic": True}
    with pytest.raises(ValueError, match="pack-quantized is only read for weight-only int"):
        CompressedTensorsConfig.from_config(cfg)


@pytest.mark.parametrize("scheme, group", [("fp8_dynamic", None), ("fp8_block", 32)])
def test_engine_on_fp8_w8a8_checkpoint(tmp_path: Path, scheme: str, group: int | None) -> None:
    path = fp8_pack.write_compressed_tensors(tiny_checkpoint("qwen3"), tmp_path / "ct", scheme,
                                             block=(32, 32))
    scores = fp8_pack.score_generation(path, tmp_path / "ct-reference", FP8_DTYPE, group)
    got = torch.tensor(scores["quantized"])
    torch.testing.assert_close(got, torch.tensor(scores["reference_rounded"]), rtol=0,
                               atol=1e-4)
    plain = (got - torch.tensor(scores["reference"])).abs().max()
    assert 1e-3 < plain < 3.0


@pytest.mark.slow
def test_engine_on_fp8_static_checkpoint_stays_close(tmp_path: Path) -> None:
    path = fp8_pack.write_compressed_tensors(tiny_checkpoint("llama"), tmp_path / "ct",
                                             "fp8_static")
    scores = fp8_pack.score_generation(path, tmp_path / "ct-reference", FP8_DTYPE)
    diff = torch.tensor(scores["quantized"]) - torch.tensor(scores["reference"])
    assert diff.abs().max() < 3.0 and diff.abs().mean() < 1.0


def test_pack_quantized_weight_only_uses_the_real_wna16_method() -> None:
    from peregrine.layers.quantization.compressed_tensors_wna16 import \
        CompressedTensorsWNA16Method
    method = _method(_wna16_cfg())
    assert isinstance(method, CompressedTensorsWNA16Method) and method.bits == 4
