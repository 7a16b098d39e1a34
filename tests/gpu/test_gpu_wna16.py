"""The compiled weight-only int dequant-GEMM matches dequantize-then-matmul (float32) at
Llama-3-8B projection shapes and batch sizes 1 to 2048, for 4-bit AWQ-style (zero points, group
128), 6 and 8-bit RTN-style (symmetric) and act-order weights; inside the engine, an AWQ model's
greedy tokens on CUDA (kernel) equal those on the CPU (dequantize + matmul), and an fp16 AWQ
model decoding 1 to 8 rows through the tensor-core GEMV picks near-exact top-1 tokens."""
from __future__ import annotations

import pytest
import torch

from gpu_cases import DEV
from peregrine.kernels.wna16_gemm import wna16_gemm
from peregrine.layers.quantization.wna16 import WNA16Layout

pytestmark = pytest.mark.gpu

# (K, N) of Llama-3-8B's projections: q/k/v fused, o, gate/up fused, down.
SHAPES = {"qkv": (4096, 4096 + 2 * 1024), "o": (4096, 4096), "gate_up": (4096, 2 * 14336),
          "down": (14336, 4096)}
BATCHES = (1, 16, 256, 2048)


def _layout(k: int, n: int, bits: int, zp: bool, dtype: torch.dtype, group: int = 128,
            act_order: bool = False) -> WNA16Layout:
    q = torch.randint(0, 1 << bits, (k, n), device=DEV, dtype=torch.int32)
    scales = torch.rand(k // group, n, device=DEV) * 0.01 + 0.002
    zeros = torch.randint(0, 1 << bits, (k // group, n), device=DEV).float() if zp else None
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k, device=DEV) // group)[torch.randperm(k, device=DEV)]
    return WNA16Layout.build(q, scales, zeros, g_idx, bits, dtype)


def _check(x: torch.Tensor, w: WNA16Layout) -> None:
    want = x.float() @ w.dequantize(torch.float32).t()  # (M, N) float32
    got = wna16_gemm(x, w)
    assert got.dtype == x.dtype and got.shape == want.shape
    # NOTE: the integers and x are exact in 16 bits and the sums float32: the output rounding
    # (2^-8 relative for bf16) dominates; scale by the output's RMS, not per element.
    err = (got.float() - want).abs().max().item() / want.pow(2).mean().sqrt().item()
    assert err < (2e-2 if x.dtype == torch.bfloat16 else 4e-3), err


@pytest.mark.parametrize("m", BATCHES)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_int4_awq_style_matches_dequantized_matmul(shape: str, m: int) -> None:
    k, n = SHAPES[shape]
    w = _layout(k, n, 4, zp=True, dtype=torch.bfloat16)
    _check(torch.randn(m, k, device=DEV, dtype=torch.bfloat16), w)


@pytest.mark.parametrize("m", (1, 16, 2048))
@pytest.mark.parametrize("bits", (6, 8))
def test_rtn_style_6_and_8_bit_match(bits: int, m: int) -> None:
    k, n = SHAPES["down"]
    w = _layout(k, n, bits, zp=False, dtype=torch.bfloat16)
    _check(torch.randn(m, k, device=DEV, dtype=torch.bfloat16), w)


@pytest.mark.parametrize("m", (1, 256))
def test_fp16_and_act_order_match(m: int) -> None:
    k, n = SHAPES["o"]
    _check(torch.randn(m, k, device=DEV, dtype=torch.float16),
           _layout(k, n, 4, zp=True, dtype=torch.float16))
    _check(torch.randn(m, k, device=DEV, dtype=torch.bfloat16),
           _layout(k, n, 4, zp=False, dtype=torch.bfloat16, act_order=True))


def test_decode_step_is_graph_capturable() -> None:
    k, n = SHAPES["qkv"]
    w = _layout(k, n, 4, zp=True, dtype=torch.bfloat16)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    want = wna16_gemm(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = wna16_gemm(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, wna16_gemm(x, w))
    assert not torch.equal(out, want)


def test_awq_model_tokens_on_cuda_equal_the_cpu_dequantized_path(tmp_path) -> None:
    from peregrine import LLM, SamplingParams
    from peregrine.testing.checkpoints import tiny_checkpoint
    from peregrine.testing.quant_pack import write_quantized_checkpoint
    path, _ = write_quantized_checkpoint(tiny_checkpoint("qwen3"), tmp_path / "awq", "awq",
                                         group_size=32)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 17, 99, 230, 41], list(range(3, 40))]
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(path), dtype="float32", device=device, max_model_len=128, seed=0)
        outs[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                      use_tqdm=False)]
        del llm
    assert outs["cuda"] == outs["cpu"]


LAYERS = 4


@pytest.fixture(scope="module")
def fp16_awq(tmp_path_factory: pytest.TempPathFactory):
    """(AWQ checkpoint, its float32 dequantized reference, prompts, params): 8 prompts that
    finish one after another, so a decode step's linears see 8 rows down to 1 (the tensor-core
    GEMV's range)."""
    from peregrine import SamplingParams
    from peregrine.testing.checkpoints import build_tiny_checkpoint
    from peregrine.testing.quant_pack import write_quantized_checkpoint
    root = tmp_path_factory.mktemp("awq-fp16")
    src = build_tiny_checkpoint(root / "src", "llama", hidden_size=512, head_dim=128,
                                num_attention_heads=8, num_key_value_heads=2,
                                intermediate_size=1024, num_hidden_layers=LAYERS,
                                max_position_embeddings=1024)
    path, ref = write_quantized_checkpoint(src, root / "awq", "awq", group_size=128)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist()
               for n in (5, 17, 40, 64, 9, 100, 23, 31)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 4 * i, ignore_eos=True)
              for i in range(len(prompts))]
    return str(path), ref, prompts, params


def _awq_tokens(path: str, prompts, params, **engine_args) -> tuple[list[list[int]], object]:
    """The engine's greedy tokens (fp16) and stats; its linears take the GEMV up to 8 rows."""
    from peregrine import LLM
    from peregrine.kernels import wna16_gemv
    engine_args.setdefault("num_gpu_blocks_override", 256)
    llm = LLM(path, dtype="float16", max_model_len=256, seed=0, **engine_args)
    try:
        linear = next(m for m in llm.engine.core_client.core.executor.worker.model_runner
                      .model.modules() if hasattr(m, "wna16"))
        assert wna16_gemv.max_rows(linear.wna16, torch.float16) == 8
        tokens = [list(o.outputs[0].token_ids)
                  for o in llm.generate(prompts, params, use_tqdm=False)]
        return tokens, llm.engine.get_stats()
    finally:
        del llm
        torch.cuda.empty_cache()


def _near_exact_top1(ref, prompts, params, tokens: list[list[int]]) -> None:
    """Every token picked is the exact top-1 of the float32 dequantized model fed the same
    tokens, or within an fp16 near-tie of it: the rounding model of test_gpu_engine.py at fp16's
    unit roundoff, to 6 sigma (on the CPU the fp16 dequantize-then-matmul path, which rounds
    every weight too, reaches 3.8 sigma on this model with 4 of 176 tokens off the top-1)."""
    import math

    from transformers import AutoModelForCausalLM
    exact = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).to(DEV).eval()
    sigma = math.sqrt(2 * (13 * LAYERS + 3) / 3) * 2.0 ** -11  # a logit pair's error / rms(z)
    gaps = []
    with torch.no_grad():
        for prompt, out in zip(prompts, tokens):
            seq = torch.tensor([prompt + out], device=DEV)
            rows = exact(seq).logits[0, len(prompt) - 1:-1].float()  # row i predicts out[i]
            picked = rows.gather(1, torch.tensor(out, device=DEV)[:, None])[:, 0]
            gaps += ((rows.max(-1).values - picked) / rows.pow(2).mean(-1).sqrt()).tolist()
    del exact
    torch.cuda.empty_cache()
    assert len(gaps) == sum(p.max_tokens for p in params)
    assert max(gaps) <= 6 * sigma, (max(gaps), 6 * sigma)
    assert sum(gap > 0 for gap in gaps) < len(gaps) / 10  # mostly the exact top-1 itself


def test_awq_decode_batches_of_1_to_8_rows_pick_near_exact_top1_tokens(fp16_awq) -> None:
    """An fp16 AWQ model (group 128; its scales as the checkpoint stores them) decoding 8 rows
    down to 1 through the tensor-core GEMV: CUDA graphs give the eager engine's tokens, and
    every token is near the exact top-1."""
    path, ref, prompts, params = fp16_awq
    graphs, _ = _awq_tokens(path, prompts, params)
    eager, _ = _awq_tokens(path, prompts, params, enforce_eager=True)
    assert graphs == eager
    _near_exact_top1(ref, prompts, params, graphs)


def test_awq_decode_with_chunked_prefill_preemption_and_prefix_hits_picks_near_exact_tokens(
        fp16_awq) -> None:
    """The same model and prompts plus two that extend earlier ones (prefix-cache hits; 10
    sequences, so the first decode steps cross the GEMV's 8-row cut-off), with 32-token prefill
    chunks and a KV pool too small for them all (recompute preemption), CUDA graphs on: every
    token near the exact top-1 of the model fed the engine's own tokens."""
    from peregrine import SamplingParams
    path, ref, prompts, params = fp16_awq
    prompts = prompts + [prompts[2] + [7, 8, 9], prompts[3] + [11] * 5]
    params = params + [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                       for n in (12, 20)]
    tokens, stats = _awq_tokens(path, prompts, params, num_gpu_blocks_override=24,
                                max_num_batched_tokens=32, preemption_mode="recompute",
                                enable_prefix_caching=True)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    _near_exact_top1(ref, prompts, params, tokens)
