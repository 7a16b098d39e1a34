"""Structured outputs through LLM.generate: every kind gives text its spec accepts, greedy and
random, with async scheduling, prefix caching and preemption; unconstrained rows are unaffected."""
from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest

from peregrine import LLM, SamplingParams
from peregrine.structured_output import StructuredOutputsParams as SO
from peregrine.testing.checkpoints import tiny_checkpoint

pytest.importorskip("xgrammar")

_PROMPTS = ["the quick brown fox", "hello world and all", "one two three four five"]
_SCHEMA = {"type": "object",
           "properties": {"name": {"type": "string", "maxLength": 6},
                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                          "pet": {"enum": ["cat", "dog"]}},
           "required": ["name", "age", "pet"], "additionalProperties": False}
_REGEX = r"[a-c]{3}-\d{2}"
_CHOICES = ["yes", "no", "maybe so"]
_GRAMMAR = 'root ::= "(" digit digit? ")" ("+" "(" digit ")")?\ndigit ::= [0-9]'


def _valid_grammar_text(text: str) -> bool:
    return re.fullmatch(r"\(\d\d?\)(\+\(\d\))?", text) is not None


def _check(kind: str, text: str) -> None:
    """Raises unless `text` is in the language of the test's spec of `kind`."""
    if kind == "json":
        jsonschema.validate(json.loads(text), _SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(_REGEX, text), text
    elif kind == "choice":
        assert text in _CHOICES, text
    else:
        assert _valid_grammar_text(text), text


_SPECS = {"json": SO(json=_SCHEMA), "json_object": SO(json_object=True), "regex": SO(regex=_REGEX),
          "choice": SO(choice=_CHOICES), "grammar": SO(grammar=_GRAMMAR)}


def _llm(async_scheduling: bool = False, **kw) -> LLM:
    return LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=256,
               async_scheduling=async_scheduling, **kw)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request) -> LLM:
    return _llm(request.param)


def _params(kind: str | None, temperature: float, **kw) -> SamplingParams:
    kw.setdefault("structured_outputs", _SPECS[kind] if kind else None)
    # NOTE: an open JSON object can go on forever: its tests check what was written by then.
    max_tokens = kw.pop("max_tokens", 32 if kind == "json_object" else 80)
    return SamplingParams(temperature=temperature, seed=5, max_tokens=max_tokens, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "random"])
@pytest.mark.parametrize("kind", list(_SPECS))
def test_each_kind_gives_valid_text(llm, kind, temperature) -> None:
    outs = llm.generate(_PROMPTS, _params(kind, temperature), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        if kind == "json_object" and c.finish_reason == "length":
            # NOTE: the tiny random model may write keys past max_tokens: what it wrote must
            # still be the start of a JSON object.
            _check_json_object_prefix(llm, c.text)
            continue
        assert c.finish_reason == "stop", (kind, c.text)
        _check(kind, c.text)
    if kind == "json_object" and temperature == 0.0:
        assert any(o.outputs[0].finish_reason == "stop" for o in outs)


def _check_json_object_prefix(llm: LLM, text: str) -> None:
    import xgrammar as xgr

    from peregrine.tokenizer import transformers_tokenizer
    tok = transformers_tokenizer(llm.get_tokenizer())  # xgrammar reads transformers' class
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=llm.engine.config.model.vocab_size)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_builtin_json_grammar())
    assert text.startswith("{") and matcher.accept_string(text), text


def test_unconstrained_rows_are_unaffected(llm) -> None:
    free = [_params(None, t, ignore_eos=True, max_tokens=12) for t in (0.0, 0.9)]
    alone = [o.outputs[0].token_ids for o in llm.generate(_PROMPTS[:2], free, use_tqdm=False)]
    mixed_params = [free[0], _params("json", 0.0), _params("regex", 1.0), free[1], _params("choice", 0.7)]
    prompts = [_PROMPTS[0], _PROMPTS[1], _PROMPTS[2], _PROMPTS[1], _PROMPTS[0]]
    outs = llm.generate(prompts, mixed_params, use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[3].outputs[0].token_ids] == alone
    _check("json", outs[1].outputs[0].text)
    _check("regex", outs[2].outputs[0].text)
    _check("choice", outs[4].outputs[0].text)


def test_the_grammar_ends_the_request_even_with_ignore_eos(llm) -> None:
    out = llm.generate(_PROMPTS[:1], _params("choice", 0.0, ignore_eos=True), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.text in _CHOICES


def test_n_sequences_each_follow_the_grammar(llm) -> None:
    out = llm.generate(_PROMPTS[:1], _params("regex", 1.0, n=3), use_tqdm=False)
    texts = [c.text for c in out[0].outputs]
    assert len(texts) == 3
    for t in texts:
        _check("regex", t)


@pytest.mark.parametrize(("field", "spec"), [
    ("json", SO(json={"type": "object", "properties": {"a": {"type": "nonsense"}}})),
    ("regex", SO(regex="[a-")), ("grammar", SO(grammar="root ::= undefined_rule")),
    ("grammar", SO(grammar="root ::= ("))])
def test_a_spec_that_does_not_compile_is_a_value_error_naming_the_field(llm, field, spec) -> None:
    with pytest.raises(ValueError, match=f"^structured_outputs.{field} "):
        llm.generate(_PROMPTS[:1], SamplingParams(structured_outputs=spec), use_tqdm=False)
    # The engine is unchanged and still serves.
    assert llm.generate(_PROMPTS[:1], _params("choice", 0.0), use_tqdm=False)[0].outputs[0].text \
        in _CHOICES


def test_equal_schemas_compile_once(llm) -> None:
    schema = dict(_SCHEMA, title="once")  # a schema no other test compiles
    text = json.dumps(dict(reversed(list(schema.items()))), indent=2)  # same schema, other text
    outs = llm.generate(_PROMPTS[:2], [_params(None, 0.0, structured_outputs=SO(json=schema)),
                                       _params(None, 0.0, structured_outputs=SO(json=text))],
                        use_tqdm=False)
    compiler = llm.engine._structure_compiler
    before = compiler.num_compiled
    outs += llm.generate(_PROMPTS[2:], _params(None, 1.0, structured_outputs=SO(json=text)),
                         use_tqdm=False)
    assert compiler.num_compiled == before
    for o in outs:
        _check("json", o.outputs[0].text)
    llm.generate(_PROMPTS[:1], _params(None, 0.0, structured_outputs=SO(json=dict(schema, title="x"))),
                 use_tqdm=False)
    assert compiler.num_compiled == before + 1


def _mixed_batch() -> tuple[list[str], list[SamplingParams]]:
    kinds = ["json", "regex", "grammar", None, "choice", "json"]
    prompts = [_PROMPTS[i % len(_PROMPTS)] + " and" * i for i in range(len(kinds))]
    return prompts, [_params(k, 0.8 if i % 2 else 0.0, ignore_eos=k is None, max_tokens=24 if k is None
                             else 80) for i, k in enumerate(kinds)]


@functools.lru_cache(maxsize=1)
def _mixed_reference() -> list[list[int]]:
    """The mixed batch's tokens: synchronous, prefix caching on, a KV pool with room to spare."""
    prompts, params = _mixed_batch()
    return [o.outputs[0].token_ids for o in _llm().generate(prompts, params, use_tqdm=False)]


_SLOW = pytest.mark.slow


@pytest.mark.parametrize(("async_scheduling", "prefix_caching", "preemption"), [
    (True, True, True), pytest.param(True, True, False, marks=_SLOW),
    pytest.param(False, False, False, marks=_SLOW), pytest.param(False, True, True, marks=_SLOW),
    pytest.param(True, False, True, marks=_SLOW)])
def test_outputs_do_not_depend_on_scheduling(async_scheduling, prefix_caching, preemption) -> None:
    prompts, params = _mixed_batch()
    ref = _mixed_reference()
    tight = dict(block_size=4, num_gpu_blocks_override=14, max_num_batched_tokens=16,
                 max_num_seqs=6) if preemption else {}
    llm = _llm(async_scheduling, enable_prefix_caching=prefix_caching, **tight)
    for _ in range(2):  # the second round hits the prefix cache when it is on
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        for o, p in zip(outs, params):
            if p.structured_outputs is not None:
                _check(p.structured_outputs.kind, o.outputs[0].text)
    if preemption:
        assert llm.engine.core_client.core.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_the_demo_model_writes_schema_valid_json() -> None:
    from peregrine.demo import demo_model_path
    llm = LLM(str(demo_model_path()), dtype="float32", device="cpu", max_model_len=256,
              async_scheduling=True)
    prompts = ["def parse(config):\n    return ", "# settings\nCONFIG = ", "data = "]
    for temperature in (0.0, 1.0):
        outs = llm.generate(prompts, _params("json", temperature), use_tqdm=False)
        for o in outs:
            assert o.outputs[0].finish_reason == "stop"
            _check("json", o.outputs[0].text)


@pytest.mark.slow
def test_the_core_in_its_own_process_gives_the_same_outputs() -> None:
    prompts, params = _mixed_batch()
    ref = _mixed_reference()
    remote = _llm(True, engine_core_process=True)
    try:
        outs = remote.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
    finally:
        remote.engine.shutdown()


def test_the_async_engine_compiles_before_queueing() -> None:
    import asyncio

    from peregrine.engine.async_engine import AsyncEngine

    async def main():
        ae = AsyncEngine(_llm().engine)
        ae.start()
        try:
            with pytest.raises(ValueError, match="^structured_outputs.regex "):
                await ae.add_request("bad", _PROMPTS[0], SamplingParams(structured_outputs=SO(regex="(")))
            stream = await ae.add_request("ok", _PROMPTS[0], _params("regex", 0.5))
            outs = [o async for o in stream]
            return outs[-1], ae.engine._structure_compiler.num_compiled
        finally:
            await ae.shutdown()
    final, num_compiled = asyncio.run(asyncio.wait_for(main(), 120))
    _check("regex", final.outputs[0].text)
    assert num_compiled == 1


def test_a_token_the_grammar_rejects_fails_only_that_request(llm) -> None:
    # allowed_token_ids leaves the grammar nothing to choose: the draw cannot follow it.
    z = llm.get_tokenizer().encode("z", add_special_tokens=False)
    bad = _params("choice", 0.0, allowed_token_ids=z)
    outs = llm.generate(_PROMPTS[:2], [bad, _params("regex", 0.0)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert len(outs[0].outputs[0].token_ids) == 1
    _check("regex", outs[1].outputs[0].text)
