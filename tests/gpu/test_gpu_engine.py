"""The Triton backend gives the torch backend's answers through the public LLM API on a GPU.

float32: identical greedy tokens, with CUDA graphs, chunked prefill, preemption, prefix caching off,
eagerly and with synchronous scheduling, and on a sliding-window (Mistral-style) model.
bfloat16: every top-1 disagreement (teacher-forced) is a near-tie that bf16 rounding can explain,
and there are no more of them than rounding predicts (the derivation is above BF16_ROUNDINGS).
"""
from __future__ import annotations

import gc
import math
from typing import NamedTuple

import pytest
import torch

from peregrine import LLM, RequestOutput, SamplingParams
from peregrine.testing.checkpoints import build_tiny_checkpoint

pytestmark = pytest.mark.gpu

NEW_TOKENS = 64
LAYERS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
ORACLE_DEVICE = "cuda"  # where transformers computes the exact (float32) logits


def _checkpoint(root, dtype: torch.dtype, arch: str = "qwen3", **overrides) -> str:
    # Big enough for real kernel shapes (head_dim 128, GQA 4:1), small enough to build in seconds.
    return str(build_tiny_checkpoint(root, arch, dtype=dtype, hidden_size=512, head_dim=128,
                                     num_attention_heads=8, num_key_value_heads=2,
                                     intermediate_size=1024, num_hidden_layers=LAYERS,
                                     max_position_embeddings=1024, **overrides))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in (7, 33, 100, 250, 16, 64)]


def _generate(path: str, prompts: list[list[int]], params: SamplingParams, before=None,
              check=None, **engine_args) -> list[RequestOutput]:
    """One engine's outputs; the engine is dropped (and its GPU memory freed) before returning.
    before(runner) runs once the engine is built, check(runner) after generating."""
    # NOTE: a fixed KV pool instead of profiling: engines built one after another on the same
    # GPU then never depend on how much memory the previous one has given back.
    engine_args.setdefault("num_gpu_blocks_override", 512)
    llm = LLM(path, max_model_len=512, **engine_args)
    runner = llm.engine.core_client.core.executor.worker.model_runner
    try:
        if before is not None:
            before(runner)
        outs = llm.generate(prompts, params, use_tqdm=False)
        if check is not None:
            check(runner)
        return outs
    finally:
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()


def _greedy_tokens(path: str, dtype: str, backend: str, **engine_args) -> list[list[int]]:
    outs = _generate(path, _prompts(), GREEDY, dtype=dtype, attention_backend=backend,
                     **engine_args)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("gpu-engine")


@pytest.fixture(scope="module")
def fp32_model(root) -> tuple[str, list[list[int]]]:
    """(path, the torch backend's eager greedy tokens)."""
    path = _checkpoint(root / "fp32", torch.float32)
    return path, _greedy_tokens(path, "float32", "torch", enforce_eager=True)


@pytest.fixture(scope="module")
def window_model(root) -> tuple[str, list[list[int]]]:
    """A 64-token sliding window, prompts up to 250 tokens: (path, torch's greedy tokens)."""
    path = _checkpoint(root / "window", torch.float32, "mistral", sliding_window=64)
    return path, _greedy_tokens(path, "float32", "torch", enforce_eager=True)


FP32_VARIANTS = {
    "graphs": {},
    "graphs+chunked": {"max_num_batched_tokens": 64},
    "graphs+preempt": {"num_gpu_blocks_override": 40},
    "graphs+no_prefix_cache": {"enable_prefix_caching": False},
    "eager": {"enforce_eager": True},
    "graphs+sync_scheduling": {"async_scheduling": False},
}


@pytest.mark.parametrize("variant", list(FP32_VARIANTS))
def test_fp32_triton_greedy_tokens_equal_torch(variant: str, fp32_model) -> None:
    path, want = fp32_model
    assert _greedy_tokens(path, "float32", "triton", **FP32_VARIANTS[variant]) == want


@pytest.mark.parametrize("variant", ["graphs", "graphs+chunked"])
def test_fp32_sliding_window_greedy_tokens_equal_torch(variant: str, window_model) -> None:
    path, want = window_model
    assert _greedy_tokens(path, "float32", "triton", **FP32_VARIANTS[variant]) == want


def test_fp32_wide_step_replays_a_coarse_piecewise_graph_with_torch_tokens(fp32_model) -> None:
    """A first step of ~2,350 prompt tokens is padded to one of the coarse sizes past 2,048."""
    path, _ = fp32_model
    prompts = [[t + k for t in p] for k in range(5) for p in _prompts()]  # 30 prompts, 2,350 tokens
    assert 2048 < sum(map(len, prompts)) <= 8192
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in _generate(
        path, prompts, params, dtype="float32", attention_backend="torch", enforce_eager=True)]

    def check(runner) -> None:
        assert runner.prefill_graphs is not None and runner.prefill_graphs.sizes[-1] >= 2560
        assert runner.timing["piecewise_graph_steps"] >= 1

    got = [list(o.outputs[0].token_ids) for o in _generate(
        path, prompts, params, check=check, dtype="float32", attention_backend="triton")]
    assert got == want


def test_fp32_mixed_steps_with_many_decodes_give_torch_tokens(fp32_model, monkeypatch) -> None:
    """Prompts chunked 64 tokens a step while more than 8 others decode: those mixed steps run
    the decode kernel beside the extend kernel between the piecewise graphs (up to 8 decodes
    ride in the extend kernel instead)."""
    import peregrine.attention.triton_backend as tb
    path, _ = fp32_model
    g = torch.Generator().manual_seed(1)
    short = [torch.randint(5, 500, (n,), generator=g).tolist() for n in range(4, 16)]  # 12
    long = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (150, 230, 310)]
    prompts = short + long  # the short ones decode while the long ones are still prefilling
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in _generate(
        path, prompts, params, dtype="float32", attention_backend="torch", enforce_eager=True)]
    decode_calls = []
    original = tb.paged_decode_attention

    def count_decode_calls(runner) -> None:  # installed after the graphs' capture
        monkeypatch.setattr(tb, "paged_decode_attention",
                            lambda *a, **k: decode_calls.append(a[0].shape[0]) or original(*a, **k))

    def check(runner) -> None:
        assert runner.timing["piecewise_graph_steps"] >= 1

    got = [list(o.outputs[0].token_ids) for o in _generate(
        path, prompts, params, before=count_decode_calls, check=check, dtype="float32",
        attention_backend="triton", max_num_batched_tokens=64)]
    # NOTE: decode-only steps replay graphs (no Python call); these calls are the mixed steps'.
    assert decode_calls and max(decode_calls) > tb.TritonAttentionBackend.fold_decodes_max
    assert got == want


# bf16 tolerance, from rounding-error analysis rather than fitted to a run:
# - a bf16 rounding has relative error |d| <= u = 2^-8 (8 significant bits, round to nearest),
#   roughly uniform, so of standard deviation u / sqrt(3);
# - GEMMs and attention accumulate in fp32 (error ~ K * 2^-24, negligible); what counts is each
#   rounding of a stored bf16 intermediate. Per layer: residual add and RMSNorm (2), qkv (1), q/k
#   norm (1), RoPE (1), attention probabilities and output (2), o_proj (1), residual add and
#   RMSNorm (2), gate/up (1), SiLU-and-mul (1), down (1) = 13; then the final residual add and norm
#   (2) and the LM head (1): n = 13 L + 3 roundings;
# - independent roundings add in quadrature (Higham & Mary, SIAM J. Sci. Comput. 2019), and the
#   residual stream and RMSNorm pass a relative error on unchanged, so the final hidden state has
#   relative error sqrt(n/3) u; through the LM head (random directions) that is sqrt(n/3) u * rms(z)
#   on one logit and sigma = sqrt(2n/3) u * rms(z) on the difference of two (z: exact logits);
# - a backend prefers b over a only if z_a - z_b < its own error on z_b - z_a, so two backends can
#   disagree on the top-1 only at an exact gap |z_a - z_b| below one backend's pair error: within
#   4 sigma (a false alarm has probability < 1e-4), about 0.095 rms(z) for L = 4;
# - the same model bounds how many disagreements to expect: one backend leaves the exact top-1 t
#   with probability p <= sum_j Q((z_t - z_j) / sigma) (Q: the normal tail), two backends disagree
#   with probability <= 2p, so the count stays below mu + 3 sqrt(mu), mu = sum of 2p over positions.
# NOTE: checked against transformers on this model (bf16 against fp32, CPU): the logit error is
# 0.018 rms(z) (the model says 0.017), 18 top-1 flips in 384 positions (the model expects 13 for
# one run against the exact logits), and the widest flip had a gap of 0.046 rms(z) (bound 0.095).
BF16_UNIT_ROUNDOFF = 2.0 ** -8
BF16_ROUNDINGS = 13 * LAYERS + 3
BF16_PAIR_SIGMA = math.sqrt(2 * BF16_ROUNDINGS / 3) * BF16_UNIT_ROUNDOFF  # in units of rms(z)
BF16_NEAR_TIE = 4 * BF16_PAIR_SIGMA


class Bf16Comparison(NamedTuple):
    positions: int
    gaps: list[float]  # per disagreement: |z_a - z_b| / rms(z) of the exact logits
    expected: float  # mu: disagreements the rounding model expects at most (on average)
    prefix_agreement: list[int]  # free-running greedy: tokens equal before the first difference


def _top1(entry: dict) -> int:
    """The rank-1 token of one prompt_logprobs entry."""
    return min(entry.items(), key=lambda kv: kv[1].rank or 1 << 30)[0]


def _normal_tail(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.erfc(x / math.sqrt(2.0))


@pytest.fixture(scope="module")
def bf16_comparison(root) -> Bf16Comparison:
    path = _checkpoint(root / "bf16", torch.bfloat16)
    prompts = _prompts()
    torch_outs = _generate(path, prompts, GREEDY, dtype="bfloat16", attention_backend="torch",
                           enforce_eager=True)
    triton_outs = _generate(path, prompts, GREEDY, dtype="bfloat16", attention_backend="triton")
    prefix = []
    for a, b in zip(torch_outs, triton_outs):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        prefix.append(next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta)))
    # Teacher-forced on the torch continuation: both backends see the same tokens everywhere.
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, torch_outs)]
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    tf = {b: _generate(path, seqs, forced, dtype="bfloat16", attention_backend=b,
                       enforce_eager=True, enable_prefix_caching=False) for b in ("torch", "triton")}
    from transformers import AutoModelForCausalLM
    exact_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    exact_model = exact_model.to(ORACLE_DEVICE).eval()
    positions, gaps, expected = 0, [], 0.0
    with torch.no_grad():
        for si, (prompt, seq) in enumerate(zip(prompts, seqs)):
            ids = torch.tensor([seq], device=ORACLE_DEVICE)  # (1, L)
            logits = exact_model(ids).logits[0].float()  # (L, V)
            rows = logits[len(prompt) - 1:len(seq) - 1]  # (n, V): row i predicts token len(p) + i
            rms = rows.pow(2).mean(-1).sqrt()  # (n,)
            below_top = rows.max(-1, keepdim=True).values - rows  # (n, V)
            tails = _normal_tail(below_top / (BF16_PAIR_SIGMA * rms[:, None]))  # (n, V)
            leave = (tails.sum(-1) - 0.5).clamp(0.0, 1.0)  # (n,): minus the top-1's own Q(0)
            expected += float(2 * leave.sum())
            for i, pos in enumerate(range(len(prompt), len(seq))):
                a = _top1(tf["torch"][si].prompt_logprobs[pos])
                b = _top1(tf["triton"][si].prompt_logprobs[pos])
                positions += 1
                if a != b:
                    gaps.append(float((rows[i, a] - rows[i, b]).abs() / rms[i]))
    del exact_model
    torch.cuda.empty_cache()
    return Bf16Comparison(positions, gaps, expected, prefix)


def test_bf16_top1_disagreements_are_near_ties(bf16_comparison: Bf16Comparison,
                                               record_property) -> None:
    record_property("bf16_disagreement_gaps_over_rms", bf16_comparison.gaps)
    record_property("bf16_near_tie_bound_over_rms", BF16_NEAR_TIE)
    record_property("bf16_greedy_prefix_agreement", bf16_comparison.prefix_agreement)
    assert bf16_comparison.positions == 6 * NEW_TOKENS
    assert all(gap <= BF16_NEAR_TIE for gap in bf16_comparison.gaps), bf16_comparison.gaps


def test_bf16_top1_agreement_rate_is_what_rounding_allows(bf16_comparison: Bf16Comparison,
                                                          record_property) -> None:
    mu = bf16_comparison.expected
    allowed = mu + 3 * math.sqrt(mu)
    n = bf16_comparison.positions
    record_property("bf16_top1_agreement", 1 - len(bf16_comparison.gaps) / n)
    record_property("bf16_agreement_floor", 1 - allowed / n)
    assert len(bf16_comparison.gaps) <= allowed, (len(bf16_comparison.gaps), mu)
