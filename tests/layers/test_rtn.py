"""Online round-to-nearest (rtn, rtn-int4/6/8): every weight within half a stored step of the
checkpoint's, the engine runs on checkpoints and on dummy weights, the bit width comes from the
method's name."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from peregrine import LLM, SamplingParams
from peregrine.config import EngineArgs
from peregrine.layers.quantization import get_quantization_config
from peregrine.layers.quantization.rtn import rtn_quantize
from peregrine.layers.quantization.wna16 import WNA16Layout
from peregrine.testing.checkpoints import tiny_checkpoint


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_dequantized_weight_is_within_half_a_step(bits: int, scale_dtype: torch.dtype) -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(bits)) * 0.05  # (N, K)
    w[3, :128] *= 40  # a group with an outlier range next to ordinary ones
    q, scales = rtn_quantize(w, bits, 128, scale_dtype)
    assert int(q.min()) >= 0 and int(q.max()) < 1 << bits
    layout = WNA16Layout.build(q, scales, None, None, bits, scale_dtype)
    deq = layout.dequantize(torch.float32)  # (N, K)
    step = scales.float().repeat_interleave(128, dim=0).t()  # (N, K)
    err = (deq - w).abs()
    assert bool((err <= step / 2 * (1 + 1e-5)).all()), float((err / step).max())
    assert float((err / step).max()) > 0.4  # it did round


def _load(path, quantization: str, **kw):
    from peregrine.attention import get_attention_backend
    from peregrine.worker.loader import load_model
    cfg = EngineArgs(model=str(path), device="cpu", dtype="float32", quantization=quantization,
                     **kw).create_engine_config().model
    return load_model(cfg, get_attention_backend("torch"), torch.device("cpu"))


@pytest.mark.parametrize("name, bits", [("rtn", 4), ("rtn-int4", 4), ("rtn-int6", 6),
                                        ("rtn-int8", 8)])
def test_method_name_picks_the_bits_and_layers_hold_the_checkpoint_rounded(name: str,
                                                                           bits: int) -> None:
    path = tiny_checkpoint("llama")
    model = _load(path, name)
    layer = model.layers[1].mlp.down_proj
    assert layer.wna16.bits == bits and not hasattr(layer, "weight")
    w = load_file(path / "model.safetensors")["model.layers.1.mlp.down_proj.weight"].float()
    step = layer.wna16.scales.float().repeat_interleave(layer.wna16.group_size, dim=0).t()
    err = (layer.wna16.dequantize(torch.float32) - w).abs()
    assert bool((err <= step / 2 * (1 + 1e-5)).all())
    assert get_quantization_config(name).bits == bits


def test_engine_generates_with_rtn_close_to_the_unquantized_model() -> None:
    path = tiny_checkpoint("qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompt = [[5, 17, 99, 230, 41, 8, 77]]
    plain = LLM(path, dtype="float32", device="cpu", max_model_len=64).generate(
        prompt, params, use_tqdm=False)[0].outputs[0]
    q8 = LLM(path, dtype="float32", device="cpu", max_model_len=64,
             quantization="rtn-int8").generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert len(q8.token_ids) == 8
    # 8-bit rounding moves the first step's chosen logprob only a little.
    first_plain = plain.logprobs[0][plain.token_ids[0]].logprob
    assert q8.token_ids[0] == plain.token_ids[0]
    assert abs(q8.logprobs[0][q8.token_ids[0]].logprob - first_plain) < 0.05


@pytest.mark.parametrize("name", ["rtn", "rtn-int6"])
def test_dummy_weights_run_quantized(name: str) -> None:
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", device="cpu", max_model_len=64,
              load_format="dummy", quantization=name)
    out = llm.generate([[5, 17, 99]], SamplingParams(temperature=0.0, max_tokens=4,
                                                     ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_rtn_config_bits_must_agree_with_the_name() -> None:
    with pytest.raises(ValueError, match="disagree"):
        get_quantization_config("rtn-int8").from_config({"bits": 4})


def test_down_projection_takes_the_activation_into_its_gemv(monkeypatch) -> None:
    """One decode row of a 4-bit MLP: the down projection's GEMV computes silu(gate) * up as it
    reads its inputs, bit for bit the activation kernel's result fed to the same GEMV; more rows
    and tensors without a kernel go through the activation kernel."""
    import peregrine.kernels.activation as activation
    import peregrine.kernels.gemv as gemv
    import peregrine.layers.quantization.wna16 as wna16
    from peregrine.attention import get_attention_backend
    from peregrine.worker.loader import load_model
    cfg = EngineArgs(model=str(tiny_checkpoint("llama")), device="cpu", dtype="bfloat16",
                     quantization="rtn").create_engine_config().model
    model = load_model(cfg, get_attention_backend("torch"), torch.device("cpu"))
    mlp = model.layers[1].mlp
    down = mlp.down_proj
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(1, 2 * down.wna16.in_features, generator=gen).to(torch.bfloat16)
    assert down.forward_silu_and_mul(h) is None  # no kernel for a CPU tensor
    # the interpreted kernels, as a GPU runs them: the GEMV for a few rows
    monkeypatch.setattr(wna16, "_use_kernel", lambda x: True)
    monkeypatch.setattr(gemv, "use_gemv", lambda x, max_m=gemv.GEMV_MAX_M:
                        0 < x.numel() // x.shape[-1] <= max_m)
    fused = down.forward_silu_and_mul(h)
    assert fused is not None and fused.shape == (1, down.wna16.out_features)
    assert torch.equal(fused, down(activation.silu_and_mul(h)))
    assert down.forward_silu_and_mul(torch.cat([h, h])) is None  # two rows: the GEMM-side path
    x = torch.randn(1, mlp.gate_up_proj.wna16.in_features, generator=gen).to(torch.bfloat16)
    mlp.act.use_fused = True
    want = down(activation.silu_and_mul(mlp.gate_up_proj(x)))

    def no_activation_kernel(_h: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the activation kernel ran for one row")

    monkeypatch.setattr(activation, "silu_and_mul", no_activation_kernel)
    assert torch.equal(mlp(x), want)
