"""IncrementalDetokenizer on a tiny byte-level BPE: text == decode(ids), no U+FFFD, stop strings."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from peregrine.engine.detokenizer import (IncrementalDetokenizer, StopStringMatcher,
                                          decode_logprob_tokens)
from peregrine.sampling_params import SamplingParams

_TRAIN = ["the quick brown fox jumps over the lazy dog", "hello world, hello there",
          "stop here or STOP there", "héllo wörld 日本語 🙂"] * 4
_TEXTS = ["héllo wörld 日本語 🙂 and the lazy dog", "🙂🙂 日本語は難しい naïve café",
          "plain ascii text only", "mixed: ü🙂ü 語, hello"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # NOTE: a small vocabulary leaves most multi-byte characters split over several byte tokens.
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<|sep|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TRAIN, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                   additional_special_tokens=["<|sep|>"], clean_up_tokenization_spaces=False)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _detok(tokenizer, prompt: str = "hello", **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, _ids(tokenizer, prompt), SamplingParams(**params))


def test_texts_really_split_characters_across_tokens(tokenizer):
    # Precondition for the tests below: some prefix of the ids decodes to an incomplete character.
    ids = _ids(tokenizer, _TEXTS[0])
    assert any(tokenizer.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))


@pytest.mark.parametrize("text", _TEXTS)
def test_text_matches_full_decode_at_every_step(tokenizer, text):
    ids = _ids(tokenizer, text)
    d = _detok(tokenizer)
    for i, tok in enumerate(ids, start=1):
        d.update([tok])
        full = tokenizer.decode(ids[:i])
        if full.endswith("\ufffd"):
            # A token ending inside a character is held back whole (its complete chars come later).
            assert full.startswith(d.output_text) and "\ufffd" not in d.output_text
        else:
            assert d.output_text == full
    assert d.output_text == text


@pytest.mark.parametrize("text", _TEXTS)
def test_deltas_never_hold_replacement_chars_and_join_to_the_text(tokenizer, text):
    d = _detok(tokenizer)
    deltas = []
    for tok in _ids(tokenizer, text):
        d.update([tok])
        deltas.append(d.get_delta_text())
    assert not any("\ufffd" in x for x in deltas)
    assert "".join(deltas) == text


def test_many_tokens_per_update_give_the_same_text(tokenizer):
    ids = _ids(tokenizer, _TEXTS[1])
    d = _detok(tokenizer)
    for i in range(0, len(ids), 3):
        d.update(ids[i:i + 3])
    assert d.output_text == _TEXTS[1]


def test_decode_window_stays_short(tokenizer):
    calls: list[int] = []
    d = _detok(tokenizer)
    decode = d._decode
    d._decode = lambda ids: calls.append(len(ids)) or decode(ids)
    ids = _ids(tokenizer, " ".join(_TEXTS) * 10)
    d.update(ids)
    assert len(ids) > 300 and max(calls) <= 12


def test_stop_string_spanning_tokens_is_found_and_cut(tokenizer):
    text = "héllo wörld 日本語 🙂 and more"
    ids = _ids(tokenizer, text)
    d = _detok(tokenizer, stop=["日本語"])
    results = [d.update([t]) for t in ids]
    assert results.count("日本語") == 1 and results[-1] is None
    assert d.output_text == "héllo wörld " and d.stop_reason == "日本語"


def test_streamed_deltas_never_show_part_of_a_stop_string(tokenizer):
    text = "hello there, say STOP now"
    d = _detok(tokenizer, stop=["STOP", "zzz"])
    sent = ""
    for tok in _ids(tokenizer, text):
        stop = d.update([tok])
        sent += d.get_delta_text()
        assert "S" not in sent
        if stop:
            break
    sent += d.get_delta_text(final=True)
    assert sent == d.output_text == "hello there, say "


def test_held_back_prefix_is_released_when_the_match_breaks(tokenizer):
    d = _detok(tokenizer, stop=["there!"])
    d.update(_ids(tokenizer, "hello ther"))
    assert d.get_delta_text() == "hello "
    d.update(_ids(tokenizer, "e."))
    assert d.get_delta_text() == "there."


def test_include_stop_str_in_output_keeps_the_stop(tokenizer):
    d = _detok(tokenizer, stop=["lazy"], include_stop_str_in_output=True)
    streamed = ""
    for tok in _ids(tokenizer, "the quick brown fox jumps over the lazy dog"):
        if d.update([tok]):
            break
        streamed += d.get_delta_text()
    streamed += d.get_delta_text()
    assert d.output_text == streamed == "the quick brown fox jumps over the lazy"


def test_earliest_stop_string_wins(tokenizer):
    d = _detok(tokenizer, stop=["dog", "fox"])
    assert d.update(_ids(tokenizer, "the quick brown fox jumps over the lazy dog")) == "fox"
    assert d.output_text == "the quick brown "


def test_final_delta_flushes_held_back_text(tokenizer):
    d = _detok(tokenizer, stop=["hello!"])
    d.update(_ids(tokenizer, "say hel"))
    assert d.get_delta_text() == "say " and d.get_output_text() == "say "
    assert d.get_delta_text(final=True) == "hel" and d.get_output_text(final=True) == "say hel"


def test_skip_special_tokens(tokenizer):
    ids = _ids(tokenizer, "hello") + [tokenizer.convert_tokens_to_ids("<|sep|>")] + _ids(tokenizer, " world")
    skipping, keeping = _detok(tokenizer), _detok(tokenizer, skip_special_tokens=False)
    skipping.update(ids), keeping.update(ids)
    assert skipping.output_text == "hello world"
    assert keeping.output_text == "hello<|sep|> world"


def test_prompt_is_not_part_of_the_output(tokenizer):
    d = _detok(tokenizer, prompt="héllo wörld 日本語 🙂")
    d.update(_ids(tokenizer, " and"))
    assert d.output_text == " and"


def test_stop_scan_work_per_update_does_not_grow_with_the_output(tokenizer):
    # NOTE: long stop strings that keep almost matching: the case that once re-scanned the whole tail.
    stops = ["ab" * 500 + f"x{i}" for i in range(8)] + ["b" * 900 + "y"]
    d = _detok(tokenizer, stop=stops)
    piece = _ids(tokenizer, "ab")
    work = []
    for _ in range(3000):
        before = d._stops.chars_scanned
        assert d.update(piece) is None
        work.append(d._stops.chars_scanned - before)
    assert len(d.output_text) == 6000
    # Flat once the partial matches are long (after 1,000 characters), not growing with the text.
    assert sum(work[-500:]) == sum(work[1000:1500])
    assert max(work) <= 2 * 2 * len(stops)  # two characters, at most two steps each per stop string
    assert d.get_delta_text() == d.output_text[:len(d.output_text) - 1000]  # held: "ab" * 500


def test_stop_matcher_finds_the_earliest_match_across_pieces():
    m = StopStringMatcher(["abcd", "bc", "zz"])
    assert m.feed("xab", 0) is None and m.held == 2
    assert m.feed("c", 3) == (2, "bc")  # "bc" completes first; "abcd" is not complete yet
    m = StopStringMatcher(["bc", "abcd"])
    assert m.feed("xabcd", 0) == (1, "abcd")  # both end in this piece: the earlier start wins
    m = StopStringMatcher(["aab"])
    assert m.feed("aaaa", 0) is None and m.held == 2
    assert m.feed("ab", 4) == (3, "aab")


def test_decode_logprob_tokens_decodes_each_token(tokenizer):
    ids = _ids(tokenizer, "hello wörld") + [tokenizer.eos_token_id]
    assert decode_logprob_tokens(tokenizer, ids) == [tokenizer.decode([i]) for i in ids]
    assert decode_logprob_tokens(tokenizer, ids)[-1] == "<eos>"


def test_sentencepiece_style_first_token_keeps_its_space():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(_TRAIN, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", clean_up_tokenization_spaces=False)
    ids = hf.encode("hello there quick fox", add_special_tokens=False)
    cut = len(hf.encode("hello", add_special_tokens=False))
    assert hf.decode(ids[cut:]) == "there quick fox"  # decoding the output alone loses the space
    d = IncrementalDetokenizer(hf, ids[:cut], SamplingParams())
    for t in ids[cut:]:
        d.update([t])
    assert d.output_text == " there quick fox"


# ------------------------------------------------------------- spaces between special tokens
@pytest.fixture(scope="module")
def wordpiece() -> PreTrainedTokenizerFast:
    """A WordPiece decoder joins tokens with spaces, added (special) tokens included."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                   additional_special_tokens=["<a>", "<b>"],
                                   clean_up_tokenization_spaces=False)


_SPECIAL_TEXT = "hello<a><b>worlds<b><a><b>"


def _wp_stream(wordpiece, step: int, **params) -> tuple[str, str]:
    """(output text, joined deltas) of _SPECIAL_TEXT's ids fed `step` tokens per update."""
    ids = wordpiece.encode(_SPECIAL_TEXT, add_special_tokens=False)
    d = IncrementalDetokenizer(wordpiece, wordpiece.encode("world <a>", add_special_tokens=False),
                               SamplingParams(skip_special_tokens=False, **params))
    deltas = []
    for i in range(0, len(ids), step):
        d.update(ids[i:i + step])
        deltas.append(d.get_delta_text())
    deltas.append(d.get_delta_text(final=True))
    return d.output_text, "".join(deltas)


@pytest.mark.parametrize("step", [1, 2, 7])
def test_adjacent_special_tokens_join_without_spaces_when_asked(wordpiece, step):
    text, streamed = _wp_stream(wordpiece, step, spaces_between_special_tokens=False)
    # NOTE: the decoder's space between a word and a special token stays (as in vLLM), and so
    # does the one after the prompt.
    assert text == streamed == " hello <a><b> worlds <b><a><b>"


@pytest.mark.parametrize("step", [1, 3])
def test_by_default_special_tokens_keep_the_decoders_spaces(wordpiece, step):
    ids = wordpiece.encode(_SPECIAL_TEXT, add_special_tokens=False)
    text, streamed = _wp_stream(wordpiece, step)
    assert text == streamed == " " + wordpiece.decode(ids, skip_special_tokens=False)
    assert text == " hello <a> <b> worlds <b> <a> <b>"


def test_spaces_flag_does_nothing_when_special_tokens_are_skipped(wordpiece):
    ids = wordpiece.encode(_SPECIAL_TEXT, add_special_tokens=False)
    d = IncrementalDetokenizer(wordpiece, [1], SamplingParams(spaces_between_special_tokens=False))
    d.update(ids)
    assert d.output_text == " " + wordpiece.decode(ids, skip_special_tokens=True)
    assert d.output_text == " hello worlds"


def test_byte_level_special_tokens_are_unchanged_by_the_flag(tokenizer):
    ids = _ids(tokenizer, "hello<|sep|><|sep|>world<eos>")
    outs = []
    for spaces in (True, False):
        d = IncrementalDetokenizer(tokenizer, _ids(tokenizer, "hi"), SamplingParams(
            skip_special_tokens=False, spaces_between_special_tokens=spaces))
        d.update(ids)
        outs.append(d.output_text)
    assert outs[0] == outs[1] == "hello<|sep|><|sep|>world<eos>"


def test_spaces_between_special_tokens_must_be_a_boolean():
    with pytest.raises(ValueError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens="no")
