"""n-gram speculative decoding on CUDA with the demo model (Triton backend, CUDA graphs): the
verify steps replay full verify graphs (or, beside a prefill chunk, the piecewise graphs), and
speculation changes no token.

Criteria: in float32 the tokens (greedy, and seeded sampling) must equal those without
speculation exactly: a verify step runs the extend kernel over k + 1 positions where a plain step
runs the decode kernel over one, which rounds differently by about 1e-6 relative in float32, far
below any gap between the top two logits that 6 prompts x 64 tokens will meet. In bfloat16 that
rounding is ~0.04 on logits of magnitude ~10: every prompt's tokens must agree up to its first
difference, and there the speculative token must be a near-tie of the plain run's (within
TIE_NATS of its top log-probability).
"""
from __future__ import annotations

import gc

import pytest
import torch

from peregrine import LLM, SamplingParams
from peregrine import demo

pytestmark = pytest.mark.gpu

PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "import os\nimport sys\n\n\ndef read_lines(path):\n    with open(path) as f:\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "    if x > 0:\n        return 1\n    if x < 0:\n        return -1\n    if x == 0:\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
TIE_NATS = 0.1


def _run(spec: dict | None, params: SamplingParams = GREEDY, **engine_args):
    """(outputs, engine stats, the runner's step counters)."""
    # NOTE: graphs for 16 sequences and 512-token steps only, so the engines start quickly.
    args = dict(num_gpu_blocks_override=512, seed=0, dtype="float32", max_num_seqs=16,
                max_prefill_graph_tokens=512)
    llm = LLM(str(demo.demo_model_path()), speculative_config=spec, **{**args, **engine_args})
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        timing = dict(llm.engine.core_client.core.executor.worker.model_runner.timing)
        return outs, llm.engine.get_stats(), timing
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def _tokens(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("engine", [
    {},
    {"enforce_eager": True},
    {"num_gpu_blocks_override": 24, "max_num_batched_tokens": 64, "preemption_mode": "recompute"},
    {"enable_prefix_caching": False, "async_scheduling": True},
], ids=["graphs", "eager", "chunked-preempted", "no-prefix-caching"])
def test_float32_greedy_tokens_equal_no_speculation(engine, record_property) -> None:
    want, _, _ = _run(None, **engine)
    got, stats, timing = _run(NGRAM, **engine)
    assert _tokens(got) == _tokens(want)
    record_property("acceptance_rate", round(stats.spec_acceptance_rate, 4))
    record_property("mean_acceptance_length", round(stats.spec_mean_acceptance_length, 3))
    assert stats.spec_num_accepted_tokens > 0
    assert timing["verify_steps"] > 0
    if not engine.get("enforce_eager"):
        # a verify step with no prefill chunk beside it replays a full verify graph; one with a
        # chunk (at most 6 x 5 tokens + the chunk) the piecewise graphs
        verify_graphs = timing.get("verify_graph_steps", 0)
        if "max_num_batched_tokens" not in engine:
            assert verify_graphs > 0
        assert verify_graphs + timing.get("piecewise_graph_steps", 0) >= timing["verify_steps"]
        if not engine:  # every prompt is admitted in the first step: no chunk beside a verify
            assert verify_graphs == timing["verify_steps"]
    if "num_gpu_blocks_override" in engine:
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=7, max_tokens=64, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=3, max_tokens=48, ignore_eos=True, n=2, logprobs=2),
], ids=["top-p-top-k", "n2-logprobs"])
def test_float32_seeded_sampling_equal_no_speculation(params) -> None:
    want, _, _ = _run(None, params)
    got, stats, _ = _run(NGRAM, params)
    assert _tokens(got) == _tokens(want)
    assert stats.spec_num_draft_tokens > 0


def test_bf16_greedy_tokens_agree_up_to_near_ties(record_property) -> None:
    want, _, _ = _run(None, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True,
                                           logprobs=5), dtype="bfloat16")
    got, stats, _ = _run(NGRAM, dtype="bfloat16")
    differ = 0
    for w, g in zip(want, got):
        a, b = list(w.outputs[0].token_ids), list(g.outputs[0].token_ids)
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            continue
        differ += 1
        top = w.outputs[0].logprobs[i]
        assert b[i] in top, (i, a[i], b[i])
        gap = top[a[i]].logprob - top[b[i]].logprob
        assert gap <= TIE_NATS, (i, a[i], b[i], gap)
    record_property("prompts_that_differ", differ)
    assert differ <= len(PROMPTS) // 2
    assert stats.spec_num_accepted_tokens > 0
