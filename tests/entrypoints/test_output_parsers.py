"""Reasoning and tool-call parsers on their own: whole outputs, and the same outputs fed in
pieces (split anywhere, inside tags too) adding up to the same answer."""
from __future__ import annotations

import json

import pytest

from peregrine.entrypoints.openai.chat_output import ChoiceOutput
from peregrine.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from peregrine.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser


def _stream(out: ChoiceOutput, pieces: list[str]) -> tuple[str, str, dict[int, dict]]:
    """Feed pieces; return the reasoning and content sent, and each call as assembled."""
    reasoning = content = ""
    calls: dict[int, dict] = {}
    for k, piece in enumerate(pieces):
        r, c, deltas = out.feed(piece, final=k == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
        for d in deltas:
            if d.index not in calls:
                assert d.id and d.function.name, "a call's first delta carries its id and name"
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
    return reasoning, content, calls


def _splits(text: str):
    """Every two-way split, and the text one character at a time."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)


# ----------------------------------------------------------------------------- reasoning
@pytest.mark.parametrize("name,tail,text,expected", [
    ("qwen3", "", "<think>\nLet me see.</think>\n\nIt is 4.", ("Let me see.", "It is 4.")),
    ("qwen3", "", "It is 4.", (None, "It is 4.")),
    ("qwen3", "", "  <thinking is fun", (None, "  <thinking is fun")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Hmm.</think>It is 4.", ("Hmm.", "It is 4.")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Cut short", ("Cut short", None)),
    ("deepseek_r1", "", "Hmm.</think>\n\nIt is 4.", ("Hmm.", "It is 4.")),
    ("deepseek_r1", "", "<think>Hmm.</think>It is 4.", ("Hmm.", "It is 4.")),
    ("deepseek_r1", "", "Still thinking", ("Still thinking", None)),
])
def test_reasoning_whole_and_streamed_agree(name, tail, text, expected):
    parser = get_reasoning_parser(name)
    assert ChoiceOutput(parser, None, tail).whole(text)[:2] == expected
    for pieces in _splits(text):
        r, c, _ = _stream(ChoiceOutput(parser, None, tail), pieces)
        assert (r if expected[0] is not None else None, c or None) == expected, pieces


def test_unknown_reasoning_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("qwen4")
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}


# ----------------------------------------------------------------------------- tool calls
_CALLS = [("get_weather", {"city": "Paris", "days": [1, 2], "note": "a \"quoted\" }"}),
          ("get_time", {})]
_FORMATS = {
    "hermes": "Checking.\n" + "".join(
        f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>\n'
        for n, a in _CALLS),
    "llama3_json": "; ".join(f'{{"name": "{n}", "parameters": {json.dumps(a)}}}' for n, a in _CALLS),
    "mistral": "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in _CALLS]),
}


@pytest.mark.parametrize("name", sorted(_FORMATS))
def test_tool_calls_whole(name):
    content, calls = get_tool_parser(name).extract(_FORMATS[name])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == _CALLS
    assert content == ("Checking." if name == "hermes" else None)


@pytest.mark.parametrize("name", sorted(_FORMATS))
def test_tool_calls_streamed_add_up_to_the_whole(name):
    text = _FORMATS[name]
    whole = ChoiceOutput(None, get_tool_parser(name), "").whole(text)
    for pieces in _splits(text):
        out = ChoiceOutput(None, get_tool_parser(name), "")
        _, content, calls = _stream(out, pieces)
        assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [
            (c.function.name, c.function.arguments) for c in whole[2]], pieces
        assert content == (whole[1] or "")
        assert out.called_tools


def test_mistral_named_calls():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
    content, calls = get_tool_parser("mistral").extract(text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert len(get_tool_parser("mistral").make_call_id()) == 9


@pytest.mark.parametrize("name,text", [
    ("hermes", 'Sure: <tool_call>{"name": "f", "arguments": {"x": </tool_call>'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", 'The answer is {"x": 1}'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}'),  # cut short
])
def test_malformed_or_absent_calls_leave_the_text_as_content(name, text):
    assert get_tool_parser(name).extract(text) == (text, [])
    _, content, calls = _stream(ChoiceOutput(None, get_tool_parser(name), ""), [text])
    assert content == text and calls == {}


def test_string_arguments_holding_json_are_decoded():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    _, calls = get_tool_parser("hermes").extract(text)
    assert calls[0].arguments == '{"x": 1}'


def test_parallel_tool_calls_false_keeps_the_first_call():
    out = ChoiceOutput(None, get_tool_parser("hermes"), "", parallel_tool_calls=False)
    _, _, calls = out.whole(_FORMATS["hermes"])
    assert [c.function.name for c in calls] == ["get_weather"]
    _, _, streamed = _stream(ChoiceOutput(None, get_tool_parser("hermes"), "", False),
                             list(_FORMATS["hermes"]))
    assert [c["name"] for c in streamed.values()] == ["get_weather"]


def test_reasoning_then_tool_call():
    text = '<think>I need the weather.</think>\n<tool_call>{"name": "w", "arguments": {}}</tool_call>'
    out = ChoiceOutput(get_reasoning_parser("qwen3"), get_tool_parser("hermes"), "")
    reasoning, content, calls = out.whole(text)
    assert reasoning == "I need the weather." and content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == [("w", "{}")]
    r, c, streamed = _stream(ChoiceOutput(get_reasoning_parser("qwen3"),
                                          get_tool_parser("hermes"), ""), list(text))
    assert r == reasoning and c == "" and streamed[0]["name"] == "w"


def test_unknown_tool_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_tool_parser("nope")
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}


@pytest.mark.parametrize("name", sorted(_FORMATS))
def test_plain_text_streams_unchanged_through_a_tool_parser(name):
    text = "  Hi there,\n  no tools needed. \n"
    assert ChoiceOutput(None, get_tool_parser(name), "").whole(text)[1] == text
    for pieces in _splits(text):
        _, content, calls = _stream(ChoiceOutput(None, get_tool_parser(name), ""), pieces)
        assert content == text and calls == {}
