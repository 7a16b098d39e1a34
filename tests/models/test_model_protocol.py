"""Every registered architecture meets the model protocol that CUDA graphs rely on, is built in
its dtype without touching torch's default, and takes its kernel choice at construction."""
from __future__ import annotations

import pytest
import torch

from peregrine.attention import get_attention_backend
from peregrine.config import EngineArgs
from peregrine.layers.kernel_config import KernelConfig
from peregrine.models.protocol import (CausalLM, PagedAttention, PiecewiseLayer, SelfAttention,
                                       final_norm)
from peregrine.testing.checkpoints import ARCHS, tiny_checkpoint
from peregrine.testing.steps import one_prefill
from peregrine.worker.loader import load_model

TOKENS = [5, 17, 99, 230, 41, 8, 77]


def _model(arch: str, dtype: str = "float32", kernels: KernelConfig | None = None):
    cfg = EngineArgs(model=str(tiny_checkpoint(arch)), dtype=dtype,
                     device="cpu").create_engine_config().model
    return cfg, load_model(cfg, get_attention_backend("torch"), torch.device("cpu"), kernels)


@pytest.mark.parametrize("arch", ARCHS)
def test_registered_models_meet_the_protocol(arch: str) -> None:
    _, model = _model(arch)
    assert isinstance(model, CausalLM)
    for layer in model.layers:
        assert isinstance(layer, PiecewiseLayer)
        assert isinstance(layer.self_attn, SelfAttention)
        assert isinstance(layer.self_attn.attn, PagedAttention)


def _run_pieces(model, ids: torch.Tensor, pos: torch.Tensor, caches, meta,
                buffers: bool) -> torch.Tensor:
    """embed → (pre_attention, which stores K/V, attention over the cache, post_attention) per
    layer → norm, as the piecewise graphs call them (into fixed q / residual buffers or not)."""
    x, residual = model.embed_tokens(ids), None
    attn = model.layers[0].self_attn
    q_buf = torch.full((len(ids), attn.num_heads, attn.head_dim), float("nan"))
    res_buf = torch.full_like(x, float("nan"))
    for layer, cache in zip(model.layers, caches):
        out = (q_buf, res_buf) if buffers else None
        q, residual = layer.pre_attention(pos, x, residual, cache, meta.slot_mapping, out=out)
        if buffers:
            assert q is q_buf and residual is res_buf
        x, residual = layer.post_attention(layer.self_attn.attn(q, None, None, cache, meta),
                                           residual)
    return final_norm(model.norm, x, residual)


@pytest.mark.parametrize("buffers", [False, True], ids=["returned", "into_buffers"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forward_equals_the_pieces_graphs_run(arch: str, buffers: bool) -> None:
    """The pieces, run as the piecewise graphs run them, give forward's hidden states exactly."""
    cfg, model = _model(arch)
    ids, pos = torch.tensor(TOKENS), torch.arange(len(TOKENS))
    with torch.inference_mode():
        caches, meta = one_prefill(cfg, len(TOKENS))
        want = model(ids, pos, caches, meta)
        caches, meta = one_prefill(cfg, len(TOKENS))
        got = _run_pieces(model, ids, pos, caches, meta, buffers)
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_kernel_layers_match_the_torch_layers(arch: str) -> None:
    """The fused kernels (q/k norm + RoPE + K/V store in one launch, RMSNorm, SiLU-and-mul) give
    the torch path's hidden states and K/V cache, through forward and through the pieces."""
    cfg, torch_model = _model(arch)
    _, fused_model = _model(arch, kernels=KernelConfig(fused=True))
    ids, pos = torch.tensor(TOKENS), torch.arange(len(TOKENS))
    with torch.inference_mode():
        want_caches, meta = one_prefill(cfg, len(TOKENS))
        want = torch_model(ids, pos, want_caches, meta)
        caches, _ = one_prefill(cfg, len(TOKENS))
        got = fused_model(ids, pos, caches, meta)
        piece_caches, _ = one_prefill(cfg, len(TOKENS))
        pieces = _run_pieces(fused_model, ids, pos, piece_caches, meta, buffers=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(pieces, got)
    for (k, v), (k_want, v_want) in zip(caches, want_caches):
        torch.testing.assert_close(k, k_want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, v_want, atol=1e-4, rtol=1e-4)
        assert k.abs().sum() > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_norms_inside_the_8_bit_gemvs_through_forward_and_the_pieces(arch: str,
                                                                     monkeypatch) -> None:
    """One token of an online-FP8 model through the CUDA dispatch (the 8-bit GEMV, run here by
    the interpreter) with the fused kernels: with the norms inside the GEMVs (a layer handing on
    hidden None, its output already in the residual), forward and the pieces (into the fixed
    buffers) give the same hidden states and cache, and the separate norm kernels' within
    float32 rounding."""
    import peregrine.layers.quantization.fp8 as fp8_mod
    import peregrine.models.decoder as decoder
    monkeypatch.setattr(fp8_mod, "use_gemv", lambda x, max_m: 0 < x.numel() // x.shape[-1]
                        <= max_m)
    monkeypatch.setattr(fp8_mod, "w8_gemv_ready", lambda w, block=None: True)
    cfg = EngineArgs(model=str(tiny_checkpoint(arch)), dtype="float32", device="cpu",
                     quantization="fp8").create_engine_config().model
    model = load_model(cfg, get_attention_backend("torch"), torch.device("cpu"),
                       KernelConfig(fused=True))
    ids, pos = torch.tensor(TOKENS[:1]), torch.arange(1)
    runs = {}
    with torch.inference_mode():
        for fuse in (True, False):
            monkeypatch.setattr(decoder, "FUSE_NORMS", fuse)
            caches, meta = one_prefill(cfg, 1)
            hidden = model(ids, pos, caches, meta)
            piece_caches, _ = one_prefill(cfg, 1)
            pieces = _run_pieces(model, ids, pos, piece_caches, meta, buffers=True)
            assert torch.equal(pieces, hidden)
            for a, b in zip(caches, piece_caches):
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            runs[fuse] = hidden, caches
    (fused, fused_caches), (plain, plain_caches) = runs[True], runs[False]
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    for a, b in zip(fused_caches, plain_caches):
        torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-4)
    with torch.inference_mode():  # the fused form ran: a layer handed on hidden None
        monkeypatch.setattr(decoder, "FUSE_NORMS", True)
        caches, meta = one_prefill(cfg, 1)
        layer = model.layers[0]
        q, residual = layer.pre_attention(pos, model.embed_tokens(ids), None, caches[0],
                                          meta.slot_mapping)
        x, _ = layer.post_attention(layer.self_attn.attn(q, None, None, caches[0], meta),
                                    residual)
    assert x is None


def test_built_in_its_dtype_without_a_process_wide_default() -> None:
    before = torch.get_default_dtype()
    _, model = _model("qwen3", dtype="bfloat16")
    assert torch.get_default_dtype() == before
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    rope = model.layers[0].self_attn.rotary_emb
    assert rope.cos_sin_cache.dtype == torch.float32  # the table stays exact


def _fused_flags(model) -> set[bool]:
    return {m.use_fused for m in model.modules() if hasattr(m, "use_fused")}


def test_kernels_are_chosen_when_the_model_is_built(monkeypatch) -> None:
    assert _fused_flags(_model("qwen3")[1]) == {False}  # the CPU default
    assert _fused_flags(_model("qwen3", kernels=KernelConfig(fused=True))[1]) == {True}
    monkeypatch.delenv("PEREGRINE_FUSED_KERNELS", raising=False)
    assert KernelConfig.for_device("cuda").fused and not KernelConfig.for_device("cpu").fused
    monkeypatch.setenv("PEREGRINE_FUSED_KERNELS", "0")
    assert not KernelConfig.for_device("cuda").fused


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    from peregrine.models.registry import model_class
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        model_class("GPT2LMHeadModel")


def test_the_store_kernel_is_told_whether_gemvs_follow(monkeypatch) -> None:
    """The fused norm/RoPE/store launch gets the output projection's `dependent_launches`
    (whether the split kernel after it may be scheduled early): False for bf16 weights, the
    method's own answer otherwise."""
    import peregrine.kernels.rope_store as rope_store
    cfg, model = _model("llama", kernels=KernelConfig(fused=True))
    seen = []
    real = rope_store.norm_rope_store

    def spy(*args, gemv_projections=False, **kwargs):
        seen.append(gemv_projections)
        return real(*args, gemv_projections=gemv_projections, **kwargs)

    monkeypatch.setattr(rope_store, "norm_rope_store", spy)
    ids, pos = torch.tensor(TOKENS), torch.arange(len(TOKENS))
    with torch.inference_mode():
        model(ids, pos, *one_prefill(cfg, len(TOKENS)))
        assert seen == [False] * len(model.layers)
        monkeypatch.setattr(model.layers[0].self_attn.o_proj.quant_method,
                            "dependent_launches", True)
        seen.clear()
        model(ids, pos, *one_prefill(cfg, len(TOKENS)))
    assert seen == [True] + [False] * (len(model.layers) - 1)


def test_a_hidden_already_in_the_residual_goes_on_as_zeros_and_is_not_added_twice() -> None:
    """A layer whose down projection added its output into the residual itself returns hidden
    None: the next stage gets (zeros, residual), which it adds back to the residual unchanged,
    and the final norm normalises the residual alone."""
    from peregrine.layers.norm import RMSNorm
    from peregrine.models.protocol import final_norm, stage_output
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    norm = RMSNorm(8, dtype=torch.float32)
    norm.weight.data.uniform_(0.5, 1.5, generator=g)
    summed = x + res
    assert torch.equal(final_norm(norm, None, summed), final_norm(norm, x, res))
    assert torch.equal(final_norm(norm, x, None), norm(x))
    sent = stage_output(None, summed)
    assert torch.equal(sent[0], torch.zeros_like(summed)) and torch.equal(sent[1], summed)
    assert torch.equal(final_norm(norm, sent[0], sent[1]), final_norm(norm, x, res))
    out = torch.full((2, 3, 8), 7.0)
    assert stage_output(None, summed, out) is out and torch.equal(out, sent)
    assert torch.equal(stage_output(x, res, out), torch.stack((x, res)))
