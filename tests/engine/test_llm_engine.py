"""LLMEngine / LLM behaviour on a tiny float32 checkpoint: sampling options, n > 1, stops, bad input."""
from __future__ import annotations

import pytest

from peregrine import LLM, RequestOutputKind, SamplingParams
from peregrine.testing.checkpoints import EOS_ID, tiny_checkpoint


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request) -> LLM:
    return LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=128,
               async_scheduling=request.param)


def _ids(n: int, start: int = 10) -> list[int]:
    return [(start + 7 * i) % 500 + 5 for i in range(n)]


def test_seeded_sampling_is_batch_independent(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    alone = llm.generate([_ids(9)], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate([_ids(30, 3), _ids(9), _ids(4, 99)], [others, sp, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    diff = SamplingParams(temperature=0.9, top_p=0.9, seed=43, max_tokens=12, ignore_eos=True)
    assert llm.generate([_ids(9)], diff, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_copies_share_prompt_blocks_and_differ(llm: LLM) -> None:
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    out = llm.generate([_ids(40)], sp, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # NOTE: the two later copies forked the first's two full prompt blocks instead of computing them.
    stats = llm.engine.core_client.core.scheduler.make_stats()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0


def test_n_copies_fork_without_prefix_caching() -> None:
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=128,
              enable_prefix_caching=False)
    sp = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate([_ids(40)], sp, use_tqdm=False)[0]
    ref = llm.generate([_ids(40)], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == ref.outputs[0].token_ids


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = llm.generate([_ids(8)], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    sp = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True)
    out = llm.generate([_ids(8)], sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    sp = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, stop_token_ids=[stop_tok])
    out = llm.generate([_ids(8)], sp, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert stop_tok not in out.token_ids  # banned until min_tokens, and 12 == min_tokens


def test_stop_string_is_not_emitted(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    text = llm.generate(["hello world"], greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[5:8]
    assert stop.strip(), f"degenerate greedy text {text!r}"
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    out = llm.generate(["hello world"], sp, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    assert EOS_ID in llm.engine.config.model.eos_token_ids
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = llm.generate([_ids(6)], sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_delta_outputs_concatenate_to_the_final_text(llm: LLM) -> None:
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    eng.add_request("delta", "the quick brown fox", sp)
    text, tokens = "", []
    while eng.has_unfinished_requests():
        for out in eng.step():
            text += out.outputs[0].text
            tokens += out.outputs[0].token_ids
    full = llm.generate(["the quick brown fox"], SamplingParams(temperature=0.0, max_tokens=10,
                                                                 ignore_eos=True), use_tqdm=False)[0]
    assert tokens == full.outputs[0].token_ids and text == full.outputs[0].text


def test_prompt_logprobs_cover_every_prompt_token(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate([_ids(20)], sp, use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 20
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert out.prompt_token_ids[pos] in entry and len(entry) <= 3


@pytest.mark.parametrize("bad, match", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
])
def test_bad_sampling_params_raise(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_bad_requests_raise_and_others_finish(llm: LLM) -> None:
    eng = llm.engine
    good = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eng.add_request("ok-1", _ids(10), good)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("too-long", _ids(200), good)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("bad-id", [1, 2, 10**6], good)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request("too-many", _ids(100), SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("ok-1", _ids(3), good)
    eng.add_request("ok-2", _ids(5), good)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == ["ok-1", "ok-2"]
    assert all(len(o.outputs[0].token_ids) == 6 for o in done.values())
    assert eng.core_client.core.scheduler.make_stats().kv_cache_usage == 0.0


def test_request_that_can_never_fit_fails_alone() -> None:
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=128,
              num_gpu_blocks_override=3)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([_ids(100), _ids(10)], sp, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "blocks" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 4


def test_abort_frees_blocks(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request("a", _ids(50), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.core_client.core.scheduler.make_stats().kv_cache_usage > 0
    eng.abort_request("a")
    assert eng.get_num_unfinished_requests() == 0
    assert eng.core_client.core.scheduler.make_stats().kv_cache_usage == 0.0
    # An in-flight step (async scheduling) drains in one more step and reports nothing for "a".
    assert all(o.request_id != "a" for o in eng.step())
    assert not eng.has_unfinished_requests()


def test_chat_uses_the_template(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.chat([{"role": "user", "content": "hi there"}], sp, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False,
                                       add_generation_prompt=True)
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 4


def test_skip_tokenizer_init_takes_token_ids() -> None:
    llm = LLM(tiny_checkpoint("qwen2", with_tokenizer=False), dtype="float32", device="cpu",
              max_model_len=64, skip_tokenizer_init=True)
    out = llm.generate([_ids(7)], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([_ids(7)], SamplingParams(stop=["x"]), use_tqdm=False)


def test_detokenize_false_returns_the_same_tokens_without_text(llm: LLM) -> None:
    prompts = [_ids(9), _ids(14, 3)]
    kw = dict(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=2,
              prompt_logprobs=1)
    full = llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)
    bare = llm.generate(prompts, SamplingParams(detokenize=False, **kw), use_tqdm=False)
    for f, b in zip(full, bare):
        assert b.outputs[0].token_ids == f.outputs[0].token_ids
        assert f.outputs[0].text and b.outputs[0].text == ""
        # the same logprobs, without their token strings
        got = [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in pos.items()}
               for pos in b.outputs[0].logprobs]
        want = [{t: (lp.logprob, lp.rank, None) for t, lp in pos.items()}
                for pos in f.outputs[0].logprobs]
        assert got == want
        assert all(lp.decoded_token is not None for pos in f.outputs[0].logprobs
                   for lp in pos.values())
        assert [None if p is None else {t: lp.decoded_token for t, lp in p.items()}
                for p in b.prompt_logprobs] == [None if p is None else dict.fromkeys(p)
                                                for p in f.prompt_logprobs]


@pytest.mark.slow
def test_async_and_sync_scheduling_sample_the_same_tokens() -> None:
    # NOTE: the sampler's noise is keyed on the token's index, which async steps must not shift.
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=5, max_tokens=12, ignore_eos=True)
    prompts = [_ids(9), _ids(25, 4), _ids(3, 77)]
    outs = []
    for mode in (False, True):
        llm = LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=128,
                  async_scheduling=mode)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
    assert outs[0] == outs[1]


def test_n_copies_fork_the_first_copy_prompt_blocks() -> None:
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=128,
              enable_prefix_caching=False)
    eng = llm.engine
    eng.add_request("fork", _ids(40), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8,
                                                     ignore_eos=True))
    first, second = (eng.core_client.core.scheduler.get_request(f"fork#{i}") for i in range(2))
    for _ in range(4):
        eng.step()
        if second.block_ids:
            break
    # The 40-token prompt has 2 full blocks; the second copy holds the same two (ref count 2).
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.num_cached_tokens == 32
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.core_client.core.scheduler.make_stats().kv_cache_usage == 0.0
