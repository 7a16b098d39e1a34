"""Speculative decoding through LLM on a tiny float32 model: the tokens (and logprobs) are those
of the same engine without speculation, greedy or seeded, with every scheduling feature."""
from __future__ import annotations

import numpy as np
import pytest

from peregrine import LLM, SamplingParams
from peregrine.spec_decode.ngram import NgramProposer
from peregrine.spec_decode.proposer import ProposeInput
from peregrine.testing.checkpoints import EOS_ID, tiny_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


def _ids(n: int, start: int = 10) -> list[int]:
    return [(start + 7 * i) % 500 + 5 for i in range(n)]


# Prompts that repeat themselves, so the n-gram proposer finds matches from the first step.
PROMPTS = [_ids(6) * 3, _ids(5, 40) * 2 + _ids(3, 40), _ids(9, 99), _ids(4, 7) * 5]


def _llm(spec=None, **kw) -> LLM:
    args = dict(dtype="float32", device="cpu", max_model_len=128, seed=0)
    args.update(kw)
    return LLM(tiny_checkpoint("llama"), speculative_config=spec, **args)


def _run(llm: LLM, params, prompts=PROMPTS):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], outs


def _accepted(llm: LLM) -> tuple[int, int]:
    st = llm.engine.get_stats()
    return st.spec_num_draft_tokens, st.spec_num_accepted_tokens


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference() -> list:
    return _run(_llm(), GREEDY)[0]


@pytest.mark.parametrize("kw", [
    {},
    pytest.param({"enable_prefix_caching": False}, marks=pytest.mark.slow),
    # chunked prefill; drafts trimmed to the budget
    pytest.param({"max_num_batched_tokens": 7}, marks=pytest.mark.slow),
    # preemption (recompute)
    pytest.param({"num_gpu_blocks_override": 12, "block_size": 4}, marks=pytest.mark.slow),
], ids=["default", "no-prefix-caching", "chunked", "preemption"])
def test_greedy_tokens_equal_without_speculation(reference, kw, monkeypatch) -> None:
    if "max_num_batched_tokens" in kw or "num_gpu_blocks_override" in kw:
        # NOTE: the tiny model's text repeats itself late, if at all; after four proposals that
        # find nothing a request backs off. Drafts from the reference (every 3rd corrupted) make
        # these schedules verify drafts, accepted and rejected, at every step.
        full = [p + seqs[0] for p, seqs in zip(PROMPTS, reference)]
        oracle = _OracleDrafts(full, wrong=3)
        monkeypatch.setattr(NgramProposer, "propose", lambda self, inp: oracle(inp))
    llm = _llm(NGRAM, **kw)
    got = _run(llm, GREEDY)[0]
    assert got == reference
    proposed, accepted = _accepted(llm)
    assert accepted > 0 and proposed > accepted  # both accepted and rejected drafts were seen
    if "num_gpu_blocks_override" in kw:
        assert llm.engine.core_client.core.scheduler.num_preemptions > 0


def test_logprobs_equal_and_mixed_batch_with_penalties() -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                             presence_penalty=0.7, frequency_penalty=0.3),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                             repetition_penalty=1.3)]
    (ref, ref_outs), (got, got_outs) = (_run(_llm(s), params) for s in (None, NGRAM))
    assert got == ref
    for i in (0, 2):
        a, b = ref_outs[i].outputs[0].logprobs, got_outs[i].outputs[0].logprobs
        assert len(a) == len(b) == 16
        for pa, pb in zip(a, b):
            assert list(pa) == list(pb)
            np.testing.assert_allclose([x.logprob for x in pa.values()],
                                       [x.logprob for x in pb.values()], rtol=0, atol=1e-4)


class _OracleDrafts:
    """Proposes the reference continuation, with every `wrong`-th draft corrupted."""

    def __init__(self, full: list[list[int]], wrong: int) -> None:
        self.full, self.wrong, self.calls = full, wrong, 0

    def __call__(self, inp: ProposeInput) -> list[list[int]]:
        out = []
        for tokens, d in zip(inp.token_ids, inp.num_draft.tolist()):
            seq = tokens.tolist()
            ref = next((f for f in self.full if f[:len(seq)] == seq), None)
            drafts = [] if ref is None else list(ref[len(seq):len(seq) + d])
            for j in range(len(drafts)):
                self.calls += 1
                if self.calls % self.wrong == 0:
                    drafts[j] = (drafts[j] + 1) % 500
            out.append(drafts)
        return out


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11, max_tokens=20, ignore_eos=True),
    pytest.param(SamplingParams(temperature=1.0, min_p=0.05, seed=3, max_tokens=20,
                                ignore_eos=True, n=2), marks=pytest.mark.slow),
    pytest.param(SamplingParams(temperature=0.8, seed=5, max_tokens=20, min_tokens=12),
                 marks=pytest.mark.slow),
], ids=["top-p-top-k", "n2-min-p", "min-tokens"])
def test_seeded_sampling_gives_the_same_tokens(monkeypatch, params) -> None:
    ref_llm = _llm()
    ref = _run(ref_llm, params)[0]
    full = [p + seq for p, seqs in zip(PROMPTS, ref) for seq in seqs]
    oracle = _OracleDrafts(full, wrong=3)
    monkeypatch.setattr(NgramProposer, "propose", lambda self, inp: oracle(inp))
    llm = _llm(NGRAM)
    assert _run(llm, params)[0] == ref
    proposed, accepted = _accepted(llm)
    assert 0 < accepted < proposed


@pytest.mark.slow
def test_drafts_of_eos_respect_min_tokens(monkeypatch) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=8)
    ref = _run(_llm(), params)[0]
    monkeypatch.setattr(NgramProposer, "propose",
                        lambda self, inp: [[EOS_ID] * int(d) for d in inp.num_draft])
    llm = _llm(NGRAM)
    got = _run(llm, params)[0]
    assert got == ref
    assert all(EOS_ID not in seq[:8] for seqs in got for seq in seqs)


@pytest.mark.slow
def test_a_plain_step_above_disable_by_batch_size() -> None:
    llm = _llm({**NGRAM, "disable_by_batch_size": 1})
    got = _run(llm, GREEDY)[0]
    assert got == _run(_llm(), GREEDY)[0]
    # four requests run together for most steps: only the last one alone speculates, if any
    proposed, _ = _accepted(llm)
    assert proposed < 4 * 24


@pytest.mark.slow
def test_structured_request_beside_speculating_ones() -> None:
    from peregrine.structured_output.params import StructuredOutputsParams
    regex = SamplingParams(temperature=0.0, max_tokens=20,
                           structured_outputs=StructuredOutputsParams(regex=r"[a-c]{3,8}"))
    params = [GREEDY, regex, GREEDY, GREEDY]
    ref = _run(_llm(), params)[0]
    llm = _llm(NGRAM)
    got, outs = _run(llm, params)
    assert got == ref
    assert all(ch in "abc" for ch in outs[1].outputs[0].text)
    assert _accepted(llm)[1] > 0


@pytest.mark.slow
def test_two_tensor_parallel_ranks_speculate_like_one_plain_process() -> None:
    # NOTE: every rank runs the proposer and verifies with the same gathered logits and noise,
    # so the ranks agree; rank 0's drafts are the ones scheduled.
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24,
                                             ignore_eos=True), GREEDY]
    want_llm = _llm()
    want = _run(want_llm, params)[0]
    want_llm.engine.shutdown()
    llm = _llm(NGRAM, tensor_parallel_size=2, num_gpu_blocks_override=40, block_size=4)
    try:
        assert _run(llm, params)[0] == want
        assert _accepted(llm)[1] > 0
    finally:
        llm.engine.shutdown()


def test_async_scheduling_pipelines_the_steps_that_propose_nothing(monkeypatch) -> None:
    # Request 0 gets the reference's drafts (every 3rd corrupted) until it finishes; the others
    # get none, so they back off and, once request 0 is done, their steps run pipelined. Request
    # 1 has penalties: it never speculates and never forces a step to complete at once.
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                             presence_penalty=0.5),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    ref = _run(_llm(), params)[0]
    oracle = _OracleDrafts([PROMPTS[0] + ref[0][0]], wrong=3)
    monkeypatch.setattr(NgramProposer, "propose", lambda self, inp: oracle(inp))
    llm = _llm(NGRAM, async_scheduling=True)
    sched = llm.engine.core_client.core.scheduler
    pipelined = []
    mark = sched.mark_in_flight
    monkeypatch.setattr(sched, "mark_in_flight", lambda out: (pipelined.append(out), mark(out)))
    assert _run(llm, params)[0] == ref
    proposed, accepted = _accepted(llm)
    assert 0 < accepted < proposed
    assert len(pipelined) >= 10, len(pipelined)
    assert not any(out.propose_drafts or out.scheduled_spec_decode_tokens for out in pipelined)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_verify_graph_steps_give_the_tokens_of_no_speculation(reference, backend) -> None:
    # NOTE: capture=False runs the verify graphs' exact steps eagerly: padded sequences and
    # tokens over the fixed buffers, fixed metadata, every logits row computed.
    from peregrine.worker.verify_graphs import VerifyGraphs
    kw = {} if backend == "torch" else {"attention_backend": "triton", "enforce_eager": True}
    llm = _llm(NGRAM, max_num_seqs=4, **kw)
    ref = reference if backend == "torch" else _run(_llm(**kw), GREEDY)[0]
    runner = llm.engine.core_client.core.executor.worker.model_runner
    runner.verify_graphs = VerifyGraphs(runner.model, runner.buffers, runner.kv_caches, 4,
                                        NGRAM["num_speculative_tokens"],
                                        llm.engine.config.scheduler.max_model_len, capture=False)
    assert runner.verify_graphs.sizes == [1, 2, 4]
    assert _run(llm, GREEDY)[0] == ref
    tm = runner.timing
    assert tm["verify_graph_steps"] > 0
    assert tm["verify_graph_steps"] == tm["verify_steps"]  # no verify step ran otherwise
    assert _accepted(llm)[1] > 0
