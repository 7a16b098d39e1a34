"""The front end's compiler (errors, cache, pickling for the core's process) and the core's
matchers (which rows get a bitmask, termination, rejected tokens)."""
from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest

from peregrine.structured_output import StructuredOutputsParams as SO
from peregrine.testing.checkpoints import EOS_ID, TINY_VOCAB_SIZE, tiny_checkpoint

xgr = pytest.importorskip("xgrammar")
from peregrine.structured_output.compiler import StructureCompiler, choice_grammar  # noqa: E402
from peregrine.structured_output.manager import StructuredOutputManager  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_checkpoint("llama")))


@pytest.fixture()
def compiler(tokenizer) -> StructureCompiler:
    return StructureCompiler(tokenizer, str(tiny_checkpoint("llama")), TINY_VOCAB_SIZE, (EOS_ID,))


def _accepts(compiled, text: str) -> bool:
    m = compiled.new_matcher()
    return m.accept_string(text) and m.is_completed()


def test_choice_grammar_is_exactly_the_choices(compiler):
    choices = ['a "quoted" \\ word', "line\nbreak", "ünï", "x"]
    compiled = compiler.compile(SO(choice=choices))
    assert all(_accepts(compiled, c) for c in choices)
    assert not _accepts(compiled, "xx") and not _accepts(compiled, "a")
    assert choice_grammar(["a"]) == 'root ::= "a"'


@pytest.mark.parametrize(("spec", "field"), [
    (SO(regex="(ab"), "regex"), (SO(grammar="root ::= missing"), "grammar"),
    (SO(json={"type": "no-such-type"}), "json")])
def test_errors_name_the_field_without_native_locations(compiler, spec, field):
    with pytest.raises(ValueError, match=f"^structured_outputs.{field} does not compile: ") as e:
        compiler.compile(spec)
    assert ".cc:" not in str(e.value)


def test_cache_hits_on_canonical_text_and_is_bounded(compiler, monkeypatch):
    a = compiler.compile(SO(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = compiler.compile(SO(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}'))
    assert a is b and compiler.num_compiled == 1
    monkeypatch.setattr("peregrine.structured_output.compiler.CACHE_SIZE", 2)
    compiler.compile(SO(regex="a"))
    compiler.compile(SO(regex="b"))  # evicts the schema
    assert compiler.compile(SO(json='{"type":"object","properties":{"x":{"type":"integer"}}}')) \
        is not a
    assert compiler.num_compiled == 4


def test_a_compiled_grammar_survives_pickling(compiler):
    compiled = compiler.compile(SO(regex=r"[0-9]{2}x"))
    again = pickle.loads(pickle.dumps(compiled))
    assert again.kind == "regex" and again.tokenizer_key == compiled.tokenizer_key
    assert _accepts(again, "12x") and not _accepts(again, "1x")


def _req(rid: str, output: list[int], computed: int, prompt_len: int = 3):
    return SimpleNamespace(request_id=rid, output_token_ids=output, num_computed_tokens=computed,
                           num_tokens=prompt_len + len(output), num_output_placeholders=0)


def test_bitmask_rows_only_for_constrained_requests_that_sample(compiler, tokenizer):
    mgr = StructuredOutputManager(TINY_VOCAB_SIZE)
    assert not mgr
    mgr.add("a", compiler.compile(SO(choice=["yes", "no"])))
    mgr.add("c", compiler.compile(SO(choice=["yes", "no"])))
    reqs = [_req("a", [], 0), _req("b", [], 0), _req("c", [], 0)]
    # "a" reaches its last prompt token, "b" is unconstrained, "c" is mid-prompt.
    ids, mask = mgr.bitmask({r.request_id: r for r in reqs}, {"a": 3, "b": 3, "c": 2})
    assert ids == ["a"] and mask.shape == (1, TINY_VOCAB_SIZE // 32) and mask.dtype == np.int32
    bits = (mask[0][:, None] >> np.arange(32)) & 1
    allowed = set(np.flatnonzero(bits.reshape(-1)).tolist())
    first = {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no")}
    assert first <= allowed and EOS_ID not in allowed


def test_matchers_terminate_and_reject(compiler, tokenizer):
    mgr = StructuredOutputManager(TINY_VOCAB_SIZE)
    for rid in ("ok", "bad"):
        mgr.add(rid, compiler.compile(SO(choice=["yes"])))
    yes = tokenizer.encode("yes", add_special_tokens=False)
    z = tokenizer.encode("z", add_special_tokens=False)
    ok, bad = _req("ok", list(yes), 0), _req("bad", z, 0)  # "z" starts no choice
    assert mgr.accept({"ok": ok}) == ([], [])  # "bad" is not live: not fed
    ok.output_token_ids.append(EOS_ID)
    terminated, rejected = mgr.accept({"ok": ok, "bad": bad})
    assert terminated == ["ok"]
    assert [r for r, _ in rejected] == ["bad"] and "not allowed" in rejected[0][1]
    assert mgr.accept({"ok": ok, "bad": bad}) == (["ok"], [])  # no second rejection
    mgr.remove(["ok", "bad", "unknown"])
    assert not mgr
