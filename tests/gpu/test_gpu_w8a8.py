"""W8A8 on CUDA at Llama-3-8B shapes: the Triton activation quantization, torch._scaled_mm
(FP8, row-wise scales), torch._int_mm (INT8, padded small batches) and the block-scaled FP8
Triton GEMM against float32 references on the same quantized values (small batches: the
weight-only GEMVs against x as it is); then the engine."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_cases import DEV, rel_err
from peregrine.kernels.fp8_quant import (FP8_DTYPE, per_token_group_quant,
                                         per_token_group_quant_ref, w8a8_block_fp8_matmul,
                                         w8a8_block_matmul_ref)
from peregrine.kernels.gemv import W8_GEMV_MAX_M
from peregrine.layers.quantization.fp8 import (TC_GEMV_MAX_M, apply_fp8_linear,
                                               fp8_gemm_supported, unrounded_rows)
from peregrine.layers.quantization.int8 import apply_int8_linear
from peregrine.testing import fp8_pack
from peregrine.testing.checkpoints import tiny_checkpoint

pytestmark = pytest.mark.gpu

# (K, N) of Llama-3-8B's qkv, o, gate_up and down projections.
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
BATCHES = [1, 7, 16, 33, 256]
# bf16 output of a float32-accumulated product: a few bf16 ulps of the largest output.
GEMM_TOL = 2 ** -6


def _needs_fp8() -> None:
    if not fp8_gemm_supported(torch.empty(1, device=DEV, dtype=torch.bfloat16)):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")


@pytest.mark.parametrize("dtype", [FP8_DTYPE, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("group", [None, 128])
def test_triton_activation_quant_matches_reference(dtype: torch.dtype, group: int | None) -> None:
    x = torch.randn(300, 14336, device=DEV, dtype=torch.bfloat16) * 3  # (M, K)
    q, s = per_token_group_quant(x, dtype, group)
    q_ref, s_ref = per_token_group_quant_ref(x, dtype, group)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    mismatch = (q.float() != q_ref.float()).float().mean().item()
    assert mismatch < 1e-4, mismatch  # a tie rounded the other way, at most rarely
    assert rel_err(q.float() * s.repeat_interleave(group or 14336, 1),
                   q_ref.float() * s_ref.repeat_interleave(group or 14336, 1)) < 2 ** -3


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", BATCHES)
def test_scaled_mm_matches_reference(k: int, n: int, m: int) -> None:
    _needs_fp8()
    w = torch.randn(n, k, device=DEV) * 0.02
    wq, ws = fp8_pack.quantize_per_channel(w, FP8_DTYPE)  # (N, K), (N, 1)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    got = apply_fp8_linear(x, wq, ws.t().contiguous(), None, None)  # (M, N) bf16
    xq, xs = per_token_group_quant_ref(x, FP8_DTYPE)
    if unrounded_rows(m, wq, ws.t()):  # small batches: the GEMVs multiply x as it is
        xq, xs = x.float(), torch.ones(m, 1, device=DEV)
    want = (xq.float() * xs) @ (wq.float() * ws).t()
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), want) < GEMM_TOL


def test_scaled_mm_with_static_input_scale() -> None:
    _needs_fp8()
    k, n = 4096, 4096
    wq, ws = fp8_pack.quantize_per_channel(torch.randn(n, k, device=DEV) * 0.02, FP8_DTYPE)
    rows = max(W8_GEMV_MAX_M, TC_GEMV_MAX_M) + 5  # past the GEMVs
    x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    scale = (x.abs().max().float() / 448).reshape(1, 1)
    got = apply_fp8_linear(x, wq, ws.t().contiguous(), scale, None)
    xq = (x.float() / scale).clamp(-448, 448).to(FP8_DTYPE).float() * scale
    assert rel_err(got.float(), xq @ (wq.float() * ws).t()) < GEMM_TOL


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", BATCHES)
def test_int_mm_matches_reference(k: int, n: int, m: int) -> None:
    w = torch.randn(n, k, device=DEV) * 0.02
    wq, ws = fp8_pack.quantize_per_channel(w, torch.int8)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    got = apply_int8_linear(x, wq, ws.t().contiguous(), None, None)
    xq, xs = per_token_group_quant_ref(x, torch.int8)
    if unrounded_rows(m, wq, ws.t()):  # small batches: the GEMVs multiply x as it is
        xq, xs = x, torch.ones(m, 1, device=DEV)
    want = (xq.double() @ wq.double().t()).float() * xs * ws.t()  # exact integer sums
    assert rel_err(got.float(), want) < 2 ** -7


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", BATCHES + [2048])
def test_block_fp8_gemm_matches_reference(k: int, n: int, m: int) -> None:
    _needs_fp8()
    block = (128, 128)
    wq, ws = fp8_pack.quantize_blocks(torch.randn(n, k, device=DEV) * 0.02, block)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    xq, xs = per_token_group_quant(x, FP8_DTYPE, 128)
    got = w8a8_block_fp8_matmul(xq, xs, wq, ws, block, torch.bfloat16)
    want = w8a8_block_matmul_ref(xq, xs, wq, ws, block, torch.float32)
    assert rel_err(got.float(), want) < GEMM_TOL


@pytest.mark.parametrize("scheme, group, act", [
    ("fp8_dynamic", None, FP8_DTYPE), ("fp8_block", 32, FP8_DTYPE),
    ("int8_dynamic", None, torch.int8)])
def test_engine_bf16_matches_rounded_reference(tmp_path: Path, scheme: str, group: int | None,
                                               act: torch.dtype) -> None:
    """Through LLM (CUDA graphs, chunked prefill, prefix caching) in bf16: the generated tokens'
    logprobs are as close to the exact (float32) rounded reference as a bf16 run of that
    reference is.

    The bound is measured, not fitted: the bf16 reference is the same rounded model computed by
    another bf16 path (one prefill, no cached K/V), so its distance to float32 is what bf16
    rounding does to these logprobs on this model, FP8 steps that flip when an input moves by
    an ulp included (on this tiny random model that alone reaches ~0.7 nats at a token and
    ~0.1 on average). The engine is one more such path and may be off by up to about twice
    that; a wrong scale, layout or rounding rule moves logprobs by the FP8 rounding itself
    (~0.5 nats on average here between rounded and unrounded inputs)."""
    if act == FP8_DTYPE:
        _needs_fp8()
    src = tiny_checkpoint("qwen3", dtype=torch.bfloat16)
    path = fp8_pack.write_compressed_tensors(src, tmp_path / "ct", scheme, block=(32, 32))
    # NOTE: decode steps (one row) take the weight-only GEMV, x not rounded; prompt chunks do.
    scores = fp8_pack.score_generation(path, tmp_path / "ct-reference", act, group,
                                       dtype="bfloat16", decode_unrounded=True,
                                       exact_reference=True)
    exact = torch.tensor(scores["reference_rounded_fp32"])
    engine = (torch.tensor(scores["quantized"]) - exact).abs()
    bf16_ref = (torch.tensor(scores["reference_rounded"]) - exact).abs()
    assert engine.mean() <= 2 * bf16_ref.mean() + 0.02, (engine.tolist(), bf16_ref.tolist())
    assert engine.max() <= 2 * bf16_ref.max() + 0.1, (engine.tolist(), bf16_ref.tolist())


@pytest.mark.parametrize("scheme, group, act", [
    ("fp8_dynamic", None, FP8_DTYPE), ("fp8_block", 32, FP8_DTYPE),
    ("int8_dynamic", None, torch.int8)])
def test_engine_fp32_matches_rounded_reference(tmp_path: Path, scheme: str, group: int | None,
                                               act: torch.dtype) -> None:
    """The same in float32, where nothing but the rounding of activations separates the engine
    from the reference: the GEMV for decode rows (x as it is), rounded prompt chunks, the
    checkpoint's scales and layouts, cached prefix blocks. Float32 sums in another order differ
    by ~1e-6; an FP8 step flipping on such a difference is rare, hence the small margin."""
    src = tiny_checkpoint("qwen3", dtype=torch.float32)
    path = fp8_pack.write_compressed_tensors(src, tmp_path / "ct", scheme, block=(32, 32))
    scores = fp8_pack.score_generation(path, tmp_path / "ct-reference", act, group,
                                       dtype="float32", decode_unrounded=True)
    diff = (torch.tensor(scores["quantized"]) - torch.tensor(scores["reference_rounded"])).abs()
    assert diff.max() < 2e-3 and diff.mean() < 2e-4, diff.tolist()


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("scheme, group", [("fp8_dynamic", None), ("fp8_block", 128),
                                           ("int8_dynamic", None)])
def test_fp8_decode_of_8_rows_down_to_1_multiplies_x_as_it_is(tmp_path: Path, monkeypatch,
                                                              scheme: str, group: int | None,
                                                              enforce_eager: bool) -> None:
    """An fp16 FP8 model (per-channel weights and per-token activations, or 128 x 128 weight
    blocks and activations per token and 128 inputs; or an INT8 W8A8 one; a small Llama whose
    projections the tensor-core GEMV reads) decoding 8 sequences that finish one after another:
    prompts, prefilled in one step, are rounded to 8 bits; every decode step of 8 rows down to 1
    multiplies x as it is (the tensor-core GEMV above the 8-bit GEMV's rows). The generated
    tokens' logprobs are as close to the float32 reference rounding only the prompts' rows as
    an fp16 run of that reference is (the bound of the bf16 test above), with CUDA graphs and
    eagerly; decode rows rounded to 8 bits instead move them by that rounding itself."""
    _needs_fp8()
    import peregrine.kernels.w8_gemv_tc as tc
    from peregrine import LLM, SamplingParams
    from peregrine.layers.quantization import fp8
    from peregrine.testing.checkpoints import build_tiny_checkpoint
    if fp8.TC_GEMV_MAX_M < 8:
        pytest.fail(f"the tensor-core GEMV is off above {fp8.TC_GEMV_MAX_M} rows")
    src = build_tiny_checkpoint(tmp_path / "src", "llama", hidden_size=512, head_dim=128,
                                num_attention_heads=8, num_key_value_heads=2,
                                intermediate_size=1024, num_hidden_layers=4,
                                max_position_embeddings=1024)
    path = fp8_pack.write_compressed_tensors(src, tmp_path / "ct", scheme, block=(128, 128))
    act = FP8_DTYPE if scheme.startswith("fp8") else torch.int8
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist()
               for n in (5, 17, 40, 64, 9, 100, 23, 31)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, logprobs=1, ignore_eos=True)
              for i in range(len(prompts))]
    served: list[int] = []
    kernel = tc.w8_gemv_tc

    def counted(x, *args, **kw):
        served.append(x.shape[0])
        return kernel(x, *args, **kw)

    monkeypatch.setattr(tc, "w8_gemv_tc", counted)
    llm = LLM(str(path), dtype="float16", max_model_len=256, seed=0, skip_tokenizer_init=True,
              enforce_eager=enforce_eager, max_num_batched_tokens=512)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    torch.cuda.empty_cache()
    # eagerly each step calls it; with graphs the capture did (padded batch sizes)
    assert set(range(max(fp8.TC_GEMV_MIN_M, 3), 9)) & set(served), served
    engine = torch.tensor([o.logprobs[i][t].logprob for o in outs
                           for i, t in enumerate(o.token_ids)])
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    ref_path = tmp_path / "ct-reference"
    scores = {}
    for dtype in ("float32", "float16"):
        ref = LLM(str(ref_path), dtype=dtype, max_model_len=256, seed=0, enforce_eager=True,
                  enable_prefix_caching=False, skip_tokenizer_init=True)
        scores[dtype] = []
        for p, o in zip(prompts, outs):
            hooks = fp8_pack.round_linear_inputs(fp8_pack.engine_model(ref), act, group, len(p))
            plp = ref.generate([p + list(o.token_ids)], forced, use_tqdm=False)[0].prompt_logprobs
            scores[dtype] += [plp[len(p) + i][t].logprob for i, t in enumerate(o.token_ids)]
            for h in hooks:
                h.remove()
        del ref
        torch.cuda.empty_cache()
    exact = torch.tensor(scores["float32"])
    err = (engine - exact).abs()
    fp16_err = (torch.tensor(scores["float16"]) - exact).abs()
    assert len(err) == sum(p.max_tokens for p in params)
    assert err.mean() <= 2 * fp16_err.mean() + 0.02, (err.tolist(), fp16_err.tolist())
    assert err.max() <= 2 * fp16_err.max() + 0.1, (err.tolist(), fp16_err.tolist())


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("dtype, tol", [("float32", 2e-3), ("bfloat16", 0.15)])
def test_norms_in_the_gemvs_keep_the_generation(tmp_path: Path, monkeypatch, dtype: str,
                                                tol: float, enforce_eager: bool) -> None:
    """A two-layer model of Llama-3-8B's widths in FP8 (per channel), one sequence (decode rows
    of one): with the RMSNorms inside the 8-bit GEMVs (residual adds in the output and down
    projections' epilogues, qkv and gate/up normalising their input), the greedy tokens'
    logprobs are those of the separate norm kernels (float32: within rounding; bf16: within
    the rounding of the normalised row, which the fused form skips), with CUDA graphs and
    eagerly, and the fused forms were what ran."""
    _needs_fp8()
    from collections import Counter
    import peregrine.layers.quantization.fp8 as fp8_mod
    import peregrine.models.decoder as decoder
    from peregrine import LLM, SamplingParams
    from peregrine.testing.checkpoints import build_tiny_checkpoint
    src = build_tiny_checkpoint(tmp_path / "src", "llama", hidden_size=4096, head_dim=128,
                                num_attention_heads=32, num_key_value_heads=8,
                                intermediate_size=14336, num_hidden_layers=2,
                                max_position_embeddings=1024)
    path = fp8_pack.write_compressed_tensors(src, tmp_path / "ct", "fp8_dynamic")
    calls: Counter = Counter()
    kernel = fp8_mod.w8_gemv

    def counted(x, *args, norm=None, residual=None, **kw):
        calls["norm" if norm is not None else "residual" if residual is not None
              else "plain"] += 1
        return kernel(x, *args, norm=norm, residual=residual, **kw)

    monkeypatch.setattr(fp8_mod, "w8_gemv", counted)
    prompt = [(7 * i + 3) % 500 + 4 for i in range(40)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, ignore_eos=True)
    runs = {}
    for fuse in (True, False):
        monkeypatch.setattr(decoder, "FUSE_NORMS", fuse)
        calls.clear()
        llm = LLM(str(path), dtype=dtype, max_model_len=256, seed=0, skip_tokenizer_init=True,
                  enforce_eager=enforce_eager)
        out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        del llm
        torch.cuda.empty_cache()
        runs[fuse] = (out, dict(calls))
    (fused, fused_calls), (plain, plain_calls) = runs[True], runs[False]
    assert fused_calls.get("norm") and fused_calls.get("residual"), fused_calls
    assert not {"norm", "residual"} & set(plain_calls), plain_calls
    if enforce_eager:  # each decode step: 2 layers x (qkv, gate/up) normed, (o, down) adding
        steps = sp.max_tokens - 1
        assert fused_calls["norm"] == fused_calls["residual"] == 2 * 2 * steps, fused_calls
    a = torch.tensor([fused.logprobs[i][t].logprob for i, t in enumerate(fused.token_ids)])
    b = torch.tensor([plain.logprobs[i][t].logprob for i, t in enumerate(plain.token_ids)])
    same = next((i for i, (x, y) in enumerate(zip(fused.token_ids, plain.token_ids)) if x != y),
                len(fused.token_ids))
    assert same >= 4, (fused.token_ids, plain.token_ids)  # near ties may part them later
    assert (a[:same] - b[:same]).abs().max() < tol, (a - b).tolist()
