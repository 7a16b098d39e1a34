"""INT8 W8A8 (SmoothQuant-style): int8 weights with per-channel scales, int8 activations per
token; on the CPU the integer products are summed exactly in float32."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peregrine.kernels.fp8_quant import per_token_group_quant_ref
from peregrine.layers.linear import QKVParallelLinear
from peregrine.layers.quantization.compressed_tensors import CompressedTensorsConfig
from peregrine.layers.quantization.int8 import Int8W8A8Method, apply_int8_linear
from peregrine.testing import fp8_pack
from peregrine.testing.checkpoints import tiny_checkpoint


def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8, rounding half away from zero, written independently."""
    scale = x.abs().amax(1, keepdim=True) / 127
    v = x / scale
    return (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-127, 127), scale


def test_int8_activation_reference_rounds_half_away_from_zero() -> None:
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, -2.5, 0.49]])
    q, s = per_token_group_quant_ref(x, torch.int8)
    assert s.item() == 1.0 and q.tolist() == [[127, 1, -1, 2, -3, 0]]


def test_int8_linear_is_the_integer_product_times_both_scales() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(9, 64), torch.randn(40, 64)
    wq, ws = fp8_pack.quantize_per_channel(w, torch.int8)  # (40, 64), (40, 1)
    xq, xs = _int8_rows(x)
    want = (xq @ wq.float().t()) * xs * ws.t()
    got = apply_int8_linear(x, wq, ws.t().contiguous(), None, torch.ones(40))
    torch.testing.assert_close(got, want + 1, rtol=1e-6, atol=1e-5)
    assert (want - x @ w.t()).abs().max() < 0.05 * (x @ w.t()).abs().max()


def test_int8_static_input_scale_saturates() -> None:
    wq = torch.eye(4, dtype=torch.int8)
    ws = torch.ones(1, 4)
    x = torch.tensor([[1.0, -3.0, 0.26, 2.0]])
    got = apply_int8_linear(x, wq, ws, torch.tensor([[0.02]]), None)
    # 1 / 0.02 = 50; -3 / 0.02 = -150 saturates at -127; 0.26 / 0.02 = 13; 2 / 0.02 = 100
    torch.testing.assert_close(got, torch.tensor([[50.0, -127.0, 13.0, 100.0]]) * 0.02)


def test_qkv_layer_loads_per_channel_scales_per_projection() -> None:
    torch.manual_seed(0)
    cfg = CompressedTensorsConfig.from_config(fp8_pack.compressed_tensors_config("int8_dynamic"))
    layer = QKVParallelLinear(64, 16, 4, 2, dtype=torch.float32, quant_config=cfg,
                              prefix="model.layers.0.self_attn.qkv_proj")
    assert isinstance(layer.quant_method, Int8W8A8Method)
    ws = [torch.randn(64, 64), torch.randn(32, 64) * 5, torch.randn(32, 64) * 0.2]
    for i, w in enumerate(ws):
        q, s = fp8_pack.quantize_per_channel(w, torch.int8)
        layer.weight_loader(layer.weight, q, i, f"w{i}")
        layer.weight_loader(layer.weight_scale, s, i, f"s{i}")
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, 64)
    xq, xs = _int8_rows(x)
    w_deq = torch.cat([q.float() * s for q, s in
                       (fp8_pack.quantize_per_channel(w, torch.int8) for w in ws)])
    torch.testing.assert_close(layer(x), (xq * xs) @ w_deq.t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_on_int8_w8a8_checkpoint(tmp_path: Path, arch: str) -> None:
    path = fp8_pack.write_compressed_tensors(tiny_checkpoint(arch), tmp_path / "w8a8",
                                             "int8_dynamic")
    scores = fp8_pack.score_generation(path, tmp_path / "w8a8-reference", torch.int8)
    got = torch.tensor(scores["quantized"])
    torch.testing.assert_close(got, torch.tensor(scores["reference_rounded"]), rtol=0,
                               atol=1e-4)
    # int8 activations (1/254 of each row's range) move the logprobs much less than FP8.
    plain = (got - torch.tensor(scores["reference"])).abs().max()
    assert 1e-4 < plain < 1.0


@pytest.mark.slow
def test_engine_on_int8_static_checkpoint_stays_close(tmp_path: Path) -> None:
    """Static per-tensor input scales calibrated on other tokens: close to the reference."""
    path = fp8_pack.write_compressed_tensors(tiny_checkpoint("llama"), tmp_path / "w8a8",
                                             "int8_static")
    scores = fp8_pack.score_generation(path, tmp_path / "w8a8-reference", torch.int8)
    diff = torch.tensor(scores["quantized"]) - torch.tensor(scores["reference"])
    assert diff.abs().max() < 1.5 and diff.abs().mean() < 0.5


def test_rounded_reference_runs_eagerly(tmp_path: Path, monkeypatch) -> None:
    """The reference's rounding hooks are registered after start-up: a CUDA graph captured then
    would replay without them, so every reference engine must run eagerly."""
    import peregrine.entrypoints.llm as llm_module
    made: list[tuple[str, dict]] = []

    class Recording(llm_module.LLM):
        def __init__(self, model=None, **kw):
            made.append((str(model), kw))
            super().__init__(model, **kw)

    monkeypatch.setattr(llm_module, "LLM", Recording)
    path = fp8_pack.write_compressed_tensors(tiny_checkpoint("llama"), tmp_path / "w8a8",
                                             "int8_dynamic")
    ref = tmp_path / "w8a8-reference"
    fp8_pack.score_generation(path, ref, torch.int8, max_tokens=2, exact_reference=True,
                              dtype="bfloat16")
    refs = [kw for model, kw in made if model == str(ref)]
    assert len(refs) == 2 and all(kw.get("enforce_eager") for kw in refs)  # bf16 and float32
    assert not any(kw.get("enforce_eager") for model, kw in made if model == str(path))
