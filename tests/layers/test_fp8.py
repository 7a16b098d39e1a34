"""FP8 W8A8: Hugging Face fp8 checkpoints (block and per-tensor scales), online FP8, and the
activation-quantization kernels. On the CPU every layer dequantizes the same FP8 values and
multiplies in float32, so outputs are compared with references built from the raw tensors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from peregrine.config import EngineArgs
from peregrine.kernels.fp8_quant import (FP8_DTYPE, FP8_MAX, block_dequantize,
                                         per_token_group_quant_ref, per_token_group_quant_triton,
                                         w8a8_block_fp8_matmul, w8a8_block_matmul_ref)
from peregrine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from peregrine.layers.quantization.fp8 import (Fp8BlockMethod, Fp8Config, Fp8OnlineMethod,
                                               Fp8W8A8Method)
from peregrine.testing import fp8_pack
from peregrine.testing.checkpoints import tiny_checkpoint


def _fake_quant_per_token(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """x rounded like an FP8 activation, written independently of the kernels module."""
    m, k = x.shape
    g = group or k
    xs = x.float().view(m, k // g, g)
    scale = xs.abs().amax(-1, keepdim=True) * (1.0 / 448.0)  # fp32(1 / 448), as the kernel
    return ((xs / scale).to(torch.float8_e4m3fn).float() * scale).view(m, k)


def test_per_token_quant_reference_rounds_each_row_to_its_own_scale() -> None:
    x = torch.randn(6, 48) * torch.logspace(-2, 2, 6)[:, None]  # rows of very different size
    q, s = per_token_group_quant_ref(x, FP8_DTYPE)
    assert q.dtype == FP8_DTYPE and s.shape == (6, 1)
    assert torch.equal(q.float().abs().amax(1), torch.full((6,), FP8_MAX))  # each row saturates
    torch.testing.assert_close(q.float() * s, _fake_quant_per_token(x), rtol=0, atol=0)
    assert (q.float() * s - x).abs().max() / x.abs().max() < 1 / 16  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("dtype", [FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("group", [None, 16])
def test_triton_group_quant_matches_reference(dtype: torch.dtype, group: int | None) -> None:
    """Values exactly representable after scaling (power-of-two scales), so the kernel's
    amax, grouping and masking are checked without depending on the interpreter's FP8 casts."""
    torch.manual_seed(0)
    m, k, g = 5, 48, group or 48
    qmax = FP8_MAX if dtype == FP8_DTYPE else 127.0
    if dtype == FP8_DTYPE:
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 96.0, 224.0])
    else:
        grid = torch.arange(-127.0, 128.0)
    values = grid[torch.randint(len(grid), (m, k))] * torch.where(torch.rand(m, k) < 0.5, -1, 1)
    values.view(m, k // g, g)[..., 0] = qmax  # every group saturates once
    scales = 2.0 ** torch.randint(-6, 4, (m, k // g)).float()
    x = values * scales.repeat_interleave(g, 1)
    q, s = per_token_group_quant_triton(x, dtype, group)
    q_ref, s_ref = per_token_group_quant_ref(x, dtype, group)
    assert torch.equal(s, s_ref) and torch.equal(s, scales)
    assert torch.equal(q.float(), q_ref.float()) and torch.equal(q.float(), values)


def test_block_gemm_kernel_matches_reference() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(5, 80), torch.randn(48, 80)  # K = 80: a ragged last block of 16
    block = (16, 32)
    aq, a_s = per_token_group_quant_ref(a, FP8_DTYPE, block[1])
    bq, b_s = fp8_pack.quantize_blocks(b, block)
    want = w8a8_block_matmul_ref(aq, a_s, bq, b_s, block, torch.float32)
    got = w8a8_block_fp8_matmul(aq, a_s, bq, b_s, block, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - a @ b.t()).abs().max() < 0.1 * (a @ b.t()).abs().max()


def _merged(method, sizes=(64, 32), k=64) -> MergedColumnParallelLinear:
    class Config(Fp8Config):
        def linear_method(self, prefixes):
            return method
    return MergedColumnParallelLinear(k, list(sizes), dtype=torch.float32,
                                      quant_config=Config(online=False),
                                      prefix="model.layers.0.mlp.gate_up_proj",
                                      shard_names=("gate_proj", "up_proj"))


def test_block_layer_matches_dequantized_weights_with_ragged_inputs() -> None:
    torch.manual_seed(0)
    block = (32, 48)  # 64 inputs: blocks of 48 and 16
    layer = _merged(Fp8BlockMethod(block), sizes=(64, 32))
    ws = [torch.randn(64, 64), torch.randn(32, 64)]
    for i, w in enumerate(ws):
        q, s = fp8_pack.quantize_blocks(w, block)
        layer.weight_loader(layer.weight, q, i, f"w{i}")
        layer.weight_loader(layer.weight_scale_inv, s, i, f"s{i}")
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(7, 64)
    w_deq = torch.cat([block_dequantize(*fp8_pack.quantize_blocks(w, block), block) for w in ws])
    want = _fake_quant_per_token(x[:, :48].contiguous()) @ w_deq[:, :48].t() + \
        _fake_quant_per_token(x[:, 48:].contiguous()) @ w_deq[:, 48:].t()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_per_tensor_scales_of_fused_projections_stay_separate() -> None:
    torch.manual_seed(0)
    layer = _merged(Fp8W8A8Method("tensor", static_input=True))
    ws = [torch.randn(64, 64) * 0.1, torch.randn(32, 64) * 10]  # very different ranges
    in_scales = [0.01, 0.02]  # the fused layer keeps the larger
    for i, w in enumerate(ws):
        q, s = fp8_pack.quantize_per_tensor(w, FP8_DTYPE)
        layer.weight_loader(layer.weight, q, i, f"w{i}")
        layer.weight_loader(layer.weight_scale, s.reshape(()), i, f"s{i}")
        layer.weight_loader(layer.input_scale, torch.tensor([in_scales[i]]), i, f"i{i}")
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight_scale.shape == (1, 96) and layer.input_scale.item() == pytest.approx(0.02)
    x = torch.randn(5, 64)
    xq = (x / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.02
    w_deq = torch.cat([q.float() * s for q, s in
                       (fp8_pack.quantize_per_tensor(w, FP8_DTYPE) for w in ws)])
    torch.testing.assert_close(layer(x), xq @ w_deq.t(), rtol=1e-5, atol=1e-5)


def test_per_tensor_scale_must_be_one_value() -> None:
    layer = _merged(Fp8W8A8Method("tensor"))
    with pytest.raises(ValueError, match="'s0'.*one value"):
        layer.weight_loader(layer.weight_scale, torch.ones(2), 0, "s0")


def test_online_fp8_quantizes_per_channel_at_load() -> None:
    torch.manual_seed(0)
    layer = RowParallelLinear(64, 48, dtype=torch.float32, quant_config=Fp8Config(online=True),
                              prefix="model.layers.0.mlp.down_proj")
    assert isinstance(layer.quant_method, Fp8OnlineMethod)
    w = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different size
    layer.weight_loader(layer.weight, w, None, "w")
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (1, 48)
    w_deq = layer.weight.float() * layer.weight_scale.t()
    assert ((w_deq - w).abs().amax(1) <= w.abs().amax(1) / 16).all()  # per-row relative error
    x = torch.randn(4, 64)
    torch.testing.assert_close(layer(x), _fake_quant_per_token(x) @ w_deq.t(), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("cfg, match", [
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "per_group"}, "activation_scheme 'per_group'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "static"),
])
def test_unsupported_fp8_configs_are_refused_by_name(cfg: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Fp8Config.from_config(cfg)


def test_block_sizes_that_do_not_divide_fused_outputs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"output sizes \[64, 32\].*multiples of 64"):
        _merged(Fp8BlockMethod((64, 64)), sizes=(64, 32))


def test_online_fp8_runs_every_benchmark_config_with_dummy_weights(tmp_path: Path) -> None:
    """Every benchmark architecture builds quantized: shrunk to two small layers, dummy weights."""
    from peregrine.attention import get_attention_backend
    from peregrine.testing.steps import one_prefill
    from peregrine.worker.loader import load_model
    configs = sorted(Path("benchmarks/configs").glob("*.json"))
    assert configs
    for path in configs:
        hf = json.loads(path.read_text())
        grouped = (hf.get("num_key_value_heads") or hf["num_attention_heads"]) < \
            hf["num_attention_heads"]
        hf.update(num_hidden_layers=2, hidden_size=128, intermediate_size=128, vocab_size=512,
                  num_attention_heads=4, num_key_value_heads=2 if grouped else 4, head_dim=32)
        folder = tmp_path / path.stem
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(hf))
        cfg = EngineArgs(model=str(folder), load_format="dummy", dtype="float32",
                         quantization="fp8", skip_tokenizer_init=True,
                         max_model_len=64).create_engine_config().model
        model = load_model(cfg, get_attention_backend("torch"), torch.device("cpu"))
        weights = [m.weight for m in model.modules() if hasattr(m, "weight_scale")]
        assert len(weights) == 8 and all(w.dtype == FP8_DTYPE for w in weights), path.name
        caches, meta = one_prefill(cfg, 5)
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.arange(5), torch.arange(5), caches, meta))
        assert torch.isfinite(logits).all(), path.name


def _check_engine(path: Path, group: int | None) -> None:
    scores = fp8_pack.score_generation(path, path.parent / f"{path.name}-reference", FP8_DTYPE,
                                       group)
    got = torch.tensor(scores["quantized"])
    # The engine (prefix caching, chunked prefill) computes what the reference computes with
    # its linear inputs rounded to FP8; float32 summation order is the only difference.
    torch.testing.assert_close(got, torch.tensor(scores["reference_rounded"]), rtol=0,
                               atol=1e-4)
    # Against the unrounded reference, FP8 activations (3 mantissa bits) move the logprobs.
    plain = (got - torch.tensor(scores["reference"])).abs().max()
    assert 1e-3 < plain < 3.0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_on_hf_fp8_block_checkpoint(tmp_path: Path, arch: str) -> None:
    path = fp8_pack.write_hf_fp8(tiny_checkpoint(arch), tmp_path / "fp8", block=(32, 32))
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    assert cfg["weight_block_size"] == [32, 32] and cfg["activation_scheme"] == "dynamic"
    _check_engine(path, group=32)


def test_engine_on_hf_fp8_per_tensor_checkpoint(tmp_path: Path) -> None:
    path = fp8_pack.write_hf_fp8(tiny_checkpoint("qwen2"), tmp_path / "fp8", block=None)
    _check_engine(path, group=None)


@pytest.mark.slow
def test_hf_fp8_static_activation_checkpoint_loads_input_scales(tmp_path: Path) -> None:
    from peregrine.entrypoints.llm import LLM
    path = fp8_pack.write_hf_fp8(tiny_checkpoint("llama"), tmp_path / "fp8", block=None,
                                 activation_scheme="static")
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    model = fp8_pack.engine_model(llm)
    scales = [m.input_scale.item() for m in model.modules() if hasattr(m, "input_scale")]
    assert len(scales) == 8 and all(0 < s < 1 for s in scales) and len(set(scales)) > 1
