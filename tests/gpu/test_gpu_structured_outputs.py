"""Structured outputs on CUDA: the grammar bitmask at Qwen3's vocabulary masks exactly what the CPU
masks, through the fused Triton draw and the compact top-k path, without a host sync; through LLM
(CUDA graphs, async scheduling on and off, eager) every kind gives valid text, the same tokens in
each mode, and unconstrained rows keep their tokens."""
from __future__ import annotations

import gc
import json
import re

import numpy as np
import pytest
import torch

from gpu_cases import DEV
from peregrine import LLM, SamplingParams
from peregrine.sample import Sampler, SamplingRows
from peregrine.structured_output import StructuredOutputsParams as SO
from peregrine.testing.checkpoints import tiny_checkpoint

pytestmark = pytest.mark.gpu

VOCAB = 151_936  # Qwen3
BATCH = 256


def _pack(allowed: np.ndarray) -> np.ndarray:
    """(G, V) bool -> (G, ceil(V / 32)) int32 in xgrammar's bit order."""
    g, v = allowed.shape
    padded = np.zeros((g, -(-v // 32) * 32), np.bool_)
    padded[:, :v] = allowed
    return np.packbits(padded.reshape(g, -1, 32), axis=-1, bitorder="little").view(np.int32)[..., 0]


def _case(device, top_k: int):
    gen = np.random.default_rng(0)
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.9, top_k=top_k, seed=i)
              for i in range(BATCH)]
    rows = SamplingRows(BATCH, VOCAB, device)
    for i, p in enumerate(params):
        rows.add_row(i, p, i, (), [0], [])
    constrained = np.arange(0, BATCH, 2)
    allowed = gen.random((constrained.size, VOCAB)) < np.where(constrained % 4 == 0, 1e-4, 0.3)[:, None]
    allowed[np.arange(constrained.size), gen.integers(0, VOCAB, constrained.size)] = True
    logits = torch.from_numpy(gen.standard_normal((BATCH, VOCAB), np.float32))
    return params, rows, constrained, allowed, logits


@pytest.mark.parametrize("top_k", [0, 50])
def test_gpu_draws_take_allowed_tokens_and_match_the_cpu_mask(top_k) -> None:
    params, rows, constrained, allowed, logits = _case(DEV, top_k)
    meta = rows.metadata(np.arange(BATCH), np.zeros(BATCH, np.int64))
    rows.add_grammar_masks(meta, constrained, _pack(allowed))
    masked = Sampler.apply_penalties(logits.to(DEV), meta).cpu()
    ref = logits.clone()
    ref[constrained] = ref[constrained].masked_fill(~torch.from_numpy(allowed), float("-inf"))
    assert torch.equal(masked, ref)
    out = Sampler()(logits.to(DEV), meta).sampled_token_ids.cpu()
    for g, r in enumerate(constrained):
        assert allowed[g, int(out[r])]
        if params[r].temperature == 0.0:
            assert int(out[r]) == int(ref[r].argmax())


def test_gpu_grammar_masks_make_no_host_sync() -> None:
    _, rows, constrained, allowed, logits = _case(DEV, 0)
    sampler = Sampler()
    x = logits.to(DEV)
    packed = _pack(allowed)
    for check in (False, True):  # the first round warms up kernels and the allocator
        if check:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(3):
                meta = rows.metadata(np.arange(BATCH), np.full(BATCH, step, np.int64))
                rows.add_grammar_masks(meta, constrained, packed)
                sampler(x, meta)
        finally:
            torch.cuda.set_sync_debug_mode("default")


_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                            "n": {"type": "integer", "minimum": 0, "maximum": 99}},
           "required": ["name", "n"], "additionalProperties": False}


def test_gpu_engine_structured_outputs_in_every_mode() -> None:
    prompts = ["the quick brown fox", "hello world and all", "one two three four five"]
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    specs = [SamplingParams(temperature=t, seed=3, max_tokens=80, structured_outputs=so)
             for t, so in [(0.0, SO(json=_SCHEMA)), (0.8, SO(regex=r"[a-c]{3}-\d{2}")),
                           (0.0, SO(choice=["yes", "no"])), (0.7, SO(grammar='root ::= "(" [0-9] ")"'))]]
    results = []
    for kw in ({}, {"async_scheduling": False}, {"enforce_eager": True}):
        llm = LLM(tiny_checkpoint("llama"), dtype="float32", max_model_len=256,
                  num_gpu_blocks_override=256, **kw)
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], free, use_tqdm=False)]
        outs = llm.generate([prompts[0]] + prompts * 2, [free] + specs + specs[:2], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == alone[0]
        texts = [o.outputs[0].text for o in outs[1:]]
        json.loads(texts[0])
        assert re.fullmatch(r"[a-c]{3}-\d{2}", texts[1]) and texts[2] in ("yes", "no")
        assert re.fullmatch(r"\([0-9]\)", texts[3])
        results.append([o.outputs[0].token_ids for o in outs])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert results[0] == results[1] == results[2]
