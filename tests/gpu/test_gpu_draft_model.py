"""The demo model with a draft on CUDA (Triton backend, the draft's decode steps in CUDA graphs):
speculation changes no greedy token, and the drafts are accepted.

Criteria: in float32 the greedy tokens must equal those without speculation exactly. In bfloat16
a verify step computes k + 1 positions at once where a plain step computes one, so the rounding
differs; there, every prompt's tokens must agree up to its first difference, and at that position
the speculative run's token must be a near-tie of the plain run's: within TIE_NATS of its top
log-probability.
"""
from __future__ import annotations

import gc

import pytest
import torch

from peregrine import LLM, SamplingParams
from peregrine import demo

pytestmark = pytest.mark.gpu

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):",
           "import os\n\n\ndef read_lines(path):\n    \"\"\"", "    for i in range(10):",
           "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(", "# sort a list\n"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
# bf16 keeps 8 significant bits: logits of magnitude ~10 round by ~0.04; a flip between two
# runs needs a gap of about twice that.
TIE_NATS = 0.1


def _draft(**extra) -> dict:
    return {"model": str(demo.demo_draft_path()), "num_speculative_tokens": 4, **extra}


def _self_draft(quant: str) -> dict:
    return {"model": str(demo.demo_model_path()), "quantization": quant,
            "num_speculative_tokens": 3}


def _run(spec: dict | None, params: SamplingParams = GREEDY, **engine_args):
    """(outputs, engine stats, whether the draft captured its decode and piecewise graphs,
    propose seconds per step)."""
    args = dict(num_gpu_blocks_override=512, seed=0, dtype="float32")
    llm = LLM(str(demo.demo_model_path()), speculative_config=spec, **{**args, **engine_args})
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        worker = llm.engine.core_client.core.executor.worker
        proposer = getattr(worker, "proposer", None)
        timing = worker.model_runner.timing
        per_step = timing.get("propose", 0.0) / max(timing.get("steps", 1), 1)
        graphs = (getattr(proposer, "graphs", None) is not None
                  and getattr(proposer, "prefill_graphs", None) is not None)
        return outs, llm.engine.get_stats(), graphs, per_step
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


_PLAIN: dict[tuple, list[list[int]]] = {}


def _plain_tokens(**engine_args) -> list[list[int]]:
    """The greedy tokens without speculation, once per engine configuration."""
    key = tuple(sorted(engine_args.items()))
    if key not in _PLAIN:
        _PLAIN[key] = _tokens(_run(None, **engine_args)[0])
    return _PLAIN[key]


@pytest.mark.parametrize("spec, engine", [
    (_draft(), {}),
    (_draft(), {"enforce_eager": True}),
    (_draft(), {"num_gpu_blocks_override": 20, "max_num_batched_tokens": 64,
                "preemption_mode": "recompute"}),
    (_self_draft("rtn"), {}),
    (_self_draft("fp8"), {}),
], ids=["draft-graphs", "draft-eager", "draft-chunked-preempted", "self-rtn", "self-fp8"])
def test_float32_greedy_tokens_equal_no_speculation(spec, engine, record_property):
    want = _plain_tokens(**engine)
    got, stats, graphs, per_step = _run(spec, **engine)
    assert _tokens(got) == want
    assert graphs == (not engine.get("enforce_eager", False))
    rate = stats.spec_acceptance_rate
    record_property("acceptance_rate", round(rate, 4))
    record_property("propose_ms_per_step", round(per_step * 1e3, 3))
    assert stats.spec_num_draft_tokens > 0 and rate > 0
    if "num_gpu_blocks_override" in engine:
        assert stats.num_preemptions > 0


def test_bf16_greedy_tokens_agree_up_to_near_ties(record_property):
    want, _, _, _ = _run(None, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True,
                                              logprobs=5), dtype="bfloat16")
    got, stats, _, _ = _run(_draft(), dtype="bfloat16")
    differ = 0
    for w, g in zip(want, got):
        a, b = list(w.outputs[0].token_ids), list(g.outputs[0].token_ids)
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            continue
        differ += 1
        top = w.outputs[0].logprobs[i]  # token id -> Logprob at the first difference
        assert b[i] in top, (i, a[i], b[i])
        gap = top[a[i]].logprob - top[b[i]].logprob
        assert gap <= TIE_NATS, (i, a[i], b[i], gap)
    record_property("prompts_that_differ", differ)
    assert differ <= len(PROMPTS) // 2
    assert stats.spec_num_accepted_tokens > 0
