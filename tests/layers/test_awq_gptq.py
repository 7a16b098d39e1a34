"""AWQ, GPTQ and compressed-tensors pack-quantized checkpoints (written in the published formats
by peregrine.testing.quant_pack) give the logits of the same model with the dequantized weights
as plain float32 weights, on one rank and split over two; bad configs are refused by name."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peregrine.config import EngineArgs
from peregrine.layers.quantization import get_quantization_config
from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.testing.gloo import run_on_gloo_ranks
from peregrine.testing.quant_pack import write_quantized_checkpoint
from peregrine.testing.steps import prefill_logits

TOKENS = [5, 17, 99, 230, 41, 8, 77, 301, 12, 64, 150, 9]

# (format, options): tiny models have 64 hidden / 128 intermediate, so groups of 16-64.
CASES = {
    "awq-g32": ("awq", dict(group_size=32)),
    "awq-g64": ("awq", dict(group_size=64)),
    "gptq-v1-asym-g32": ("gptq", dict(group_size=32)),
    "gptq-v1-sym-g32": ("gptq", dict(group_size=32, sym=True)),
    "gptq-v2-asym-g16": ("gptq_v2", dict(group_size=16)),
    "gptq-act-order-g16": ("gptq", dict(group_size=16, sym=True, act_order=True)),
    "gptq-int8-channel": ("gptq_v2", dict(bits=8, group_size=-1)),
    "gptq-int8-act-order": ("gptq", dict(bits=8, group_size=32, act_order=True)),
    "ct-w4a16-sym-g32": ("compressed-tensors", dict(group_size=32, sym=True)),
    "ct-w4a16-asym-g32": ("compressed-tensors", dict(group_size=32)),
    "ct-w4a16-channel": ("compressed-tensors", dict(group_size=-1, sym=True)),
    "ct-w8a16-sym-g64": ("compressed-tensors", dict(bits=8, group_size=64, sym=True)),
    "ct-w4a16-actorder": ("compressed-tensors", dict(group_size=16, sym=True, act_order=True)),
}


def _logits(path: str) -> torch.Tensor:
    """Logits of one prefill through the torch backend (tensor-parallel when a group is set)."""
    return prefill_logits(path, TOKENS)


def _write(tmp_path: Path, arch: str, case: str) -> tuple[Path, Path]:
    fmt, opts = CASES[case]
    return write_quantized_checkpoint(tiny_checkpoint(arch), tmp_path / f"{arch}-{case}", fmt,
                                      **opts)


# Every case on Llama; Qwen3 (q/k norms, tied embeddings, head_dim 32) on one per format.
_ARCH_CASES = [("llama", c) for c in sorted(CASES)] + [
    ("qwen3", c) for c in ("awq-g32", "gptq-act-order-g16", "ct-w4a16-asym-g32")]


@pytest.mark.parametrize("arch, case", _ARCH_CASES)
def test_checkpoint_gives_the_dequantized_models_logits(tmp_path: Path, arch: str,
                                                        case: str) -> None:
    path, reference = _write(tmp_path, arch, case)
    got = _logits(str(path))
    torch.testing.assert_close(got, _logits(str(reference)), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, _logits(str(tiny_checkpoint(arch))), atol=1e-3)  # did round


def test_layers_hold_only_the_repacked_weight(tmp_path: Path) -> None:
    from peregrine.attention import get_attention_backend
    from peregrine.worker.loader import load_model
    path, _ = _write(tmp_path, "llama", "gptq-v1-sym-g32")
    cfg = EngineArgs(model=str(path), device="cpu").create_engine_config().model
    model = load_model(cfg, get_attention_backend("torch"), torch.device("cpu"))
    layer = model.layers[0].mlp.gate_up_proj
    names = {n for n, _ in layer.named_parameters()}
    assert names == {"wna16_qweight", "wna16_scales"}  # symmetric: no zeros; g_idx unused
    assert layer.wna16_qweight.shape == (64 // 8, 2 * 128)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["awq-g32", "gptq-act-order-g16", "gptq-int8-channel",
                                  "ct-w4a16-asym-g32", "ct-w4a16-channel", "ct-w4a16-actorder"])
def test_checkpoint_splits_over_two_ranks(tmp_path: Path, case: str) -> None:
    """Column layers split outputs (packed zeros and all), row layers inputs; act-order and
    per-channel row layers keep every group's scales on each rank."""
    path, reference = _write(tmp_path, "llama", case)
    want = _logits(str(reference))
    torch.testing.assert_close(run_on_gloo_ranks(_logits, 2, str(path)), want,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cfg, match", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128, "version": "gemm"}, "3-bit"),
    ({"quant_method": "awq", "bits": 4, "group_size": 100}, "group_size 100"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size 0"),
])
def test_unsupported_configs_are_named(cfg: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_quantization_config(cfg["quant_method"]).from_config(cfg)


def test_requesting_awq_for_a_plain_checkpoint_is_refused() -> None:
    with pytest.raises(ValueError, match="not AWQ-quantized"):
        EngineArgs(model=str(tiny_checkpoint("llama")), quantization="awq").create_engine_config()


def test_compressed_tensors_scheme_is_checked() -> None:
    from peregrine.layers.quantization.compressed_tensors_wna16 import \
        CompressedTensorsWNA16Method
    with pytest.raises(ValueError, match="strategy 'tensor'"):
        CompressedTensorsWNA16Method({"num_bits": 4, "strategy": "tensor", "symmetric": True})
    with pytest.raises(ValueError, match="positive group_size"):
        CompressedTensorsWNA16Method({"num_bits": 4, "strategy": "group", "group_size": None})
    with pytest.raises(ValueError, match="2-bit"):
        CompressedTensorsWNA16Method({"num_bits": 2, "strategy": "channel"})


def test_group_size_that_does_not_divide_the_inputs_is_named(tmp_path: Path) -> None:
    path, _ = write_quantized_checkpoint(tiny_checkpoint("llama"), tmp_path / "m", "gptq",
                                         group_size=32)
    import json
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 48
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not a multiple of group_size 48"):
        _logits(str(path))


def test_fused_projections_with_different_act_orders_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    path, _ = _write(tmp_path, "llama", "gptq-act-order-g16")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="g_idx differs between the fused projections"):
        _logits(str(path))
