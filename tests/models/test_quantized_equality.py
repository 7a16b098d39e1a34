"""Peregrine on AWQ and GPTQ int4 checkpoints of tiny Llama-3.1-style and Qwen3 models: greedy
tokens equal transformers' on the same model with the dequantized weights loaded as plain float32
weights, and logprobs agree closely."""
from __future__ import annotations

import functools
import math
import tempfile
from pathlib import Path

import pytest
import torch

from peregrine import LLM, SamplingParams
from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.testing.oracle import hf_greedy
from peregrine.testing.quant_pack import write_quantized_checkpoint

NEW_TOKENS = 24
PROMPT_LENS = (5, 17, 33)
CASES = {
    "awq": ("awq", dict(group_size=32)),
    "gptq-act-order": ("gptq", dict(group_size=16, act_order=True)),
    "gptq-v2-sym": ("gptq_v2", dict(group_size=64, sym=True)),
}
_ROOT = Path(tempfile.mkdtemp(prefix="peregrine-quantized-"))


@functools.lru_cache(maxsize=None)
def _checkpoints(arch: str, case: str) -> tuple[Path, Path]:
    fmt, opts = CASES[case]
    return write_quantized_checkpoint(tiny_checkpoint(arch), _ROOT / f"{arch}-{case}", fmt,
                                      **opts)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4321)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


# NOTE: slow (about 20 s each on two cores); tests/layers/test_awq_gptq.py checks every format's
# logits against the dequantized model in the fast tier.
@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_greedy_matches_transformers_on_dequantized_weights(arch: str, case: str) -> None:
    quantized, reference = _checkpoints(arch, case)
    want_tokens, want_lps = hf_greedy(reference, _prompts, NEW_TOKENS)
    llm = LLM(str(quantized), dtype="float32", device="cpu", max_model_len=128, seed=0)
    assert llm.engine.config.model.quantization.name == CASES[case][0].removesuffix("_v2")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate(_prompts(llm.engine.config.model.vocab_size), params, use_tqdm=False)
    for out, want, rows in zip(outs, want_tokens, want_lps):
        assert out.outputs[0].token_ids == want, f"{arch} {case}: greedy tokens differ"
        for pos, entry in enumerate(out.outputs[0].logprobs):
            for tok, lp in entry.items():
                assert math.isclose(lp.logprob, rows[pos][tok].item(), abs_tol=1e-4), (pos, tok)
