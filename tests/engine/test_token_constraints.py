"""allowed_token_ids and bad_words through LLM.generate on a tiny float32 checkpoint: every token is
allowed, no bad word is completed, and the tokens are the same with async scheduling, prefix
caching and preemption on or off."""
from __future__ import annotations

import pytest

from peregrine import LLM, SamplingParams
from peregrine.testing.checkpoints import tiny_checkpoint

_PROMPTS = ["the quick brown fox", "hello world and all", "one two three four five",
            "the quick brown fox jumps"]
_GREEDY = dict(temperature=0.0, max_tokens=16, ignore_eos=True)


def _llm(async_scheduling: bool = False, **kw) -> LLM:
    return LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=128,
               async_scheduling=async_scheduling, **kw)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request) -> LLM:
    return _llm(request.param)


@pytest.fixture(scope="module")
def greedy(llm: LLM) -> list[list[int]]:
    """The unconstrained greedy tokens of _PROMPTS."""
    return _tokens(llm, _PROMPTS, SamplingParams(**_GREEDY))


def _tokens(llm: LLM, prompts: list[str], params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _word_sequences(llm: LLM, words: list[str]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    p = SamplingParams(bad_words=words).with_bad_word_tokens(
        lambda w: tok.encode(w, add_special_tokens=False))
    return p._bad_words_token_ids


def _completions(ids: list[int], seqs: list[list[int]]) -> list[int]:
    """Indices of the tokens that complete an occurrence of some sequence in `ids`."""
    return sorted(i + len(q) - 1 for q in seqs for i in range(len(ids) - len(q) + 1)
                  if ids[i:i + len(q)] == q)


def _pick_bad_word(llm: LLM, greedy: list[int]) -> str:
    """A two-token word that greedy decoding produces (after its first two tokens)."""
    tok = llm.get_tokenizer()
    for i in range(2, len(greedy) - 1):
        word = tok.decode(greedy[i:i + 2])
        if word.strip() == word and greedy[i:i + 2] in _word_sequences(llm, [word]):
            return word
    raise AssertionError(f"no two-token word to ban in {greedy}")


def _check_bad_word_outputs(ref: list[list[int]], out: list[list[int]], seqs: list[list[int]]) -> None:
    """No sequence is completed; each output follows the unconstrained one up to its first
    completion and leaves it there."""
    for r, o in zip(ref, out):
        assert not _completions(o, seqs), (o, seqs)
        hits = _completions(r, seqs)
        if not hits:
            assert o == r
        else:
            assert o[:hits[0]] == r[:hits[0]] and o[hits[0]] != r[hits[0]]


# ---- allowed_token_ids ----------------------------------------------------------------------------
def test_allowed_token_ids_covering_the_greedy_output_change_nothing(llm, greedy) -> None:
    ref = greedy[:2]
    allowed = sorted(set(ref[0]) | set(ref[1]))
    assert _tokens(llm, _PROMPTS[:2], SamplingParams(**_GREEDY, allowed_token_ids=allowed)) == ref


def test_greedy_takes_the_best_allowed_token_when_its_own_is_removed(llm, greedy) -> None:
    ref = greedy[0]
    removed = ref[3]
    allowed = sorted(set(ref) - {removed}) + [7, 300]
    out = _tokens(llm, _PROMPTS[:1], SamplingParams(**_GREEDY, allowed_token_ids=allowed))[0]
    assert out[:3] == ref[:3] and out[3] != removed
    assert set(out) <= set(allowed)


def test_allowed_token_ids_restrict_every_random_draw(llm: LLM) -> None:
    allowed = [5, 17, 42, 99, 256, 400]
    sp = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True,
                        allowed_token_ids=allowed)
    outs = [o.token_ids for o in llm.generate(_PROMPTS[:1], sp, use_tqdm=False)[0].outputs]
    drawn = {t for o in outs for t in o}
    assert drawn <= set(allowed) and len(drawn) > 2


def test_allowed_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    vocab = llm.engine.config.model.vocab_size
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(_PROMPTS[:1], SamplingParams(allowed_token_ids=[1, vocab]), use_tqdm=False)


# ---- bad_words ------------------------------------------------------------------------------------
def test_a_bad_word_greedy_produces_never_appears(llm, greedy) -> None:
    ref = greedy
    word = _pick_bad_word(llm, ref[0])
    seqs = _word_sequences(llm, [word])
    out = _tokens(llm, _PROMPTS, SamplingParams(**_GREEDY, bad_words=[word]))
    assert _completions(ref[0], seqs)
    _check_bad_word_outputs(ref, out, seqs)


def test_bad_words_and_allowed_token_ids_together_in_one_batch(llm, greedy) -> None:
    ref = greedy[:2]
    word = _pick_bad_word(llm, ref[1])
    seqs = _word_sequences(llm, [word])
    allowed = sorted(set(ref[1]) | {3, 9, 27})
    both = SamplingParams(**_GREEDY, bad_words=[word], allowed_token_ids=allowed)
    plain = SamplingParams(**_GREEDY)
    out = _tokens(llm, _PROMPTS[:2], [plain, both])
    assert out[0] == ref[0]  # the unconstrained neighbour is untouched
    assert set(out[1]) <= set(allowed)
    _check_bad_word_outputs(ref[1:], out[1:], seqs)


# ---- the same tokens whatever the scheduling --------------------------------------------------------
def _mixed_params(word: str) -> list[SamplingParams]:
    seeded = dict(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    return [SamplingParams(**_GREEDY, bad_words=[word]),
            SamplingParams(**seeded, bad_words=[word, "the"]),
            SamplingParams(**seeded, allowed_token_ids=list(range(40, 140)), bad_words=[word]),
            SamplingParams(**_GREEDY, bad_words=[word], allowed_token_ids=list(range(200, 512)))]


_REFERENCE: dict[str, object] = {}


def _reference() -> tuple[list[SamplingParams], list[list[int]], list[list[int]]]:
    """(params, their tokens, the bad word's sequences) on the plain engine (sync, prefix caching
    on, room for everything), built once."""
    if not _REFERENCE:
        base = _llm()
        plain = _tokens(base, _PROMPTS, SamplingParams(**_GREEDY))
        word = _pick_bad_word(base, plain[0])
        params = _mixed_params(word)
        ref = _tokens(base, _PROMPTS, params)
        seqs = _word_sequences(base, [word])
        _check_bad_word_outputs(plain[:1], ref[:1], seqs)
        _REFERENCE.update(params=params, ref=ref, seqs=seqs)
    return _REFERENCE["params"], _REFERENCE["ref"], _REFERENCE["seqs"]


@pytest.mark.slow
@pytest.mark.parametrize(("async_scheduling", "prefix_caching", "preemption"), [
    (True, True, False), (False, False, False), (True, False, False), (False, True, True),
    (True, True, True)])
def test_constrained_tokens_do_not_depend_on_scheduling(async_scheduling, prefix_caching,
                                                         preemption) -> None:
    params, ref, seqs = _reference()
    tight = dict(block_size=4, num_gpu_blocks_override=10, max_num_batched_tokens=12,
                 max_num_seqs=4) if preemption else {}
    llm = _llm(async_scheduling, enable_prefix_caching=prefix_caching, **tight)
    for _ in range(2):  # the second round hits the prefix cache when it is on
        out = _tokens(llm, _PROMPTS, params)
        assert out == ref
        assert all(not _completions(o, seqs) for o in out)
    if preemption:
        assert llm.engine.core_client.core.scheduler.num_preemptions > 0
