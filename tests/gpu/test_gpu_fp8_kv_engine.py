"""An FP8 KV cache through the LLM API on a GPU: the tensor-core FP8 decode kernel gives the
decode logprobs of the former CUDA-core FP8 kernel, with CUDA graphs, chunked prefill,
preemption and prefix caching on and off (fp16 model, so both kernels run)."""
from __future__ import annotations

import gc

import pytest
import torch

from peregrine import LLM, SamplingParams
from peregrine.kernels import decode_configs
from peregrine.testing.checkpoints import build_tiny_checkpoint

pytestmark = pytest.mark.gpu

NEW_TOKENS = 48
# Two kernels over the same FP8 cache: the tensor-core one rounds p to fp16 for P.V, the former
# one sums in fp32. At fp16 activations that moves a logprob by a few 1e-3; a near-tie margin
# below TOL may flip a greedy token, after which the two runs are different texts.
TOL = 0.03


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("fp8-kv-engine")
    # head dim 128, 4 q heads per kv head: a shape the tensor-core kernel takes
    return str(build_tiny_checkpoint(root, "qwen3", dtype=torch.float16, hidden_size=512,
                                     head_dim=128, num_attention_heads=8,
                                     num_key_value_heads=2, intermediate_size=1024,
                                     num_hidden_layers=4, max_position_embeddings=1024))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in (9, 40, 130, 300, 17, 70)]


def _run(path: str, mma: bool, monkeypatch, **engine_args) -> list:
    """[(tokens, per-token top-2 logprob dicts)] of greedy decoding with an FP8 cache."""
    monkeypatch.setattr(decode_configs, "FP8_MMA", mma)
    engine_args.setdefault("num_gpu_blocks_override", 512)
    llm = LLM(path, dtype="float16", kv_cache_dtype="fp8", max_model_len=512, **engine_args)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                logprobs=2)
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def former(model) -> list:
    with pytest.MonkeyPatch.context() as mp:
        return _run(model, False, mp)


VARIANTS = {
    "graphs": {},
    "graphs+chunked": {"max_num_batched_tokens": 64},
    "graphs+preempt": {"num_gpu_blocks_override": 40},
    "graphs+no_prefix_cache": {"enable_prefix_caching": False},
    "eager": {"enforce_eager": True},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_core_fp8_decode_gives_the_former_kernels_logprobs(variant: str, model, former,
                                                                  monkeypatch) -> None:
    got = _run(model, True, monkeypatch, **VARIANTS[variant])
    compared = 0
    for (tokens, lps), (want_tokens, want_lps) in zip(got, former):
        for tok, want, lp, want_lp in zip(tokens, want_tokens, lps, want_lps):
            if tok != want:  # only where the former run's top two were a near-tie
                top2 = sorted((p.logprob for p in want_lp.values()), reverse=True)[:2]
                assert top2[0] - top2[1] <= 2 * TOL, (variant, top2)
                break
            assert abs(lp[tok].logprob - want_lp[tok].logprob) <= TOL, (variant, lp[tok],
                                                                        want_lp[tok])
            compared += 1
    assert compared >= len(got) * NEW_TOKENS // 3  # most of the text agrees token for token
