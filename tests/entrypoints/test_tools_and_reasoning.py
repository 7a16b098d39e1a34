"""Tool calling (tool_choice auto/none) and reasoning output through the server and the openai
client, over an engine that answers with canned text in pieces split inside tags and JSON."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from fake_engine import FakeEngine
from server_utils import RunningServer
from peregrine.entrypoints.openai.api_server import ServerArgs
from peregrine.outputs import CompletionOutput, RequestOutput

MODEL = "fake-model"
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
# A Qwen-like template: it lists the tools, writes earlier calls with tojson, and reads
# enable_thinking / open_think (chat_template_kwargs) the way Qwen3's templates do.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t.function.name }}: "
    "{{ t.function.description }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif open_think %}<think>\n{% endif %}{% endif %}")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _pieces(text: str, size: int = 5) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


class CannedEngine(FakeEngine):
    """Every sequence answers `self.pieces`, one piece (one token) per step, then stops."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.tokenizer.chat_template = TEMPLATE
        self.pieces: list[str] = ["Hello."]
        self.prompts: list[str] = []

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0) -> None:
        super().add_request(request_id, prompt, params, arrival_time, priority)
        self.prompts.append(self.tokenizer.decode(self.waiting[-1].prompt_ids))

    def step(self) -> list[RequestOutput]:
        self.running += self.waiting
        self.waiting = []
        outputs = []
        for req in list(self.running):
            outs = []
            for i, seq in enumerate(req.seqs):
                k = len(seq.tokens)
                seq.tokens.append(self.cycle[0])
                if k + 1 == len(self.pieces):
                    seq.finish_reason = "stop"
                elif len(seq.tokens) >= req.params.max_tokens:
                    seq.finish_reason = "length"
                outs.append(CompletionOutput(index=i, text=self.pieces[k], token_ids=[self.cycle[0]],
                                             finish_reason=seq.finish_reason))
            finished = all(s.finish_reason for s in req.seqs)
            outputs.append(RequestOutput(req.request_id, None, req.prompt_ids, outs, finished,
                                         metrics=req.metrics))
            if finished:
                self.running.remove(req)
        return outputs


@pytest.fixture(scope="module")
def server():
    with RunningServer(CannedEngine(max_model_len=1024), reasoning_parser="qwen3",
                       enable_auto_tool_choice=True, tool_call_parser="hermes") as s:
        yield s


@pytest.fixture()
def engine(server) -> CannedEngine:
    return server.async_engine.engine


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _stream(client, **kw):
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return reasoning, content, calls, finish


# ----------------------------------------------------------------------------- reasoning
def test_reasoning_goes_to_reasoning_content(client, engine):
    engine.pieces = _pieces("<think>\nAdd them: 2+2.</think>\n\nIt is 4.", 3)
    r = client.chat.completions.create(model=MODEL, messages=CHAT)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "Add them: 2+2." and msg.content == "It is 4."
    assert _stream(client, messages=CHAT)[:2] == ("Add them: 2+2.", "It is 4.")


def test_include_reasoning_false_leaves_the_reasoning_out(client, engine):
    engine.pieces = _pieces("<think>\nAdd them: 2+2.</think>\n\nIt is 4.", 3)
    kw = {"messages": CHAT, "extra_body": {"include_reasoning": False}}
    msg = client.chat.completions.create(model=MODEL, **kw).choices[0].message
    assert msg.model_extra["reasoning_content"] is None and msg.content == "It is 4."
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    assert all(getattr(c.choices[0].delta, "reasoning_content", None) is None
               for c in chunks if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "It is 4."


def test_include_reasoning_false_with_logprobs_is_400(server):
    r = httpx.post(server.base_url + "/v1/chat/completions", json={
        "messages": CHAT, "include_reasoning": False, "logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include_reasoning"


def test_template_that_opens_the_think_block_starts_in_reasoning(client, engine):
    """chat_template_kwargs reach the template; a prompt ending in <think> makes the output
    reasoning until </think>."""
    engine.pieces = _pieces("Hmm, 4.</think>It is 4.")
    kw = {"messages": CHAT, "extra_body": {"chat_template_kwargs": {"open_think": True}}}
    r = client.chat.completions.create(model=MODEL, **kw)
    assert engine.prompts[-1].endswith("<think>\n")
    assert r.choices[0].message.model_extra["reasoning_content"] == "Hmm, 4."
    assert r.choices[0].message.content == "It is 4."
    assert _stream(client, **kw)[:2] == ("Hmm, 4.", "It is 4.")


def test_enable_thinking_false_reaches_the_template(client, engine):
    engine.pieces = ["It is 4."]
    r = client.chat.completions.create(model=MODEL, messages=CHAT,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert engine.prompts[-1].endswith("<think>\n\n</think>\n\n")
    assert r.choices[0].message.content == "It is 4."
    assert r.choices[0].message.model_extra["reasoning_content"] is None


@pytest.mark.parametrize("field,value", [("reasoning_parser", "qwen9"),
                                         ("tool_call_parser", "nope")])
def test_unknown_parser_is_refused_at_start_up(field, value, capsys):
    with pytest.raises(ValueError, match=value):
        ServerArgs(**{field: value})
    from peregrine.entrypoints.serve import serve_main
    assert serve_main(["--" + field.replace("_", "-"), value]) == 2
    assert value in capsys.readouterr().err


def test_auto_tool_choice_needs_a_parser():
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerArgs(enable_auto_tool_choice=True)


# ----------------------------------------------------------------------------- tools
def test_tool_call_is_parsed_into_tool_calls(client, engine):
    engine.pieces = _pieces("<think>Need the weather.</think>\n" + CALL, 4)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert "get_weather: Current weather of a city" in engine.prompts[-1]  # the template saw tools


def test_streamed_tool_call_sends_the_arguments_in_deltas(client, engine):
    engine.pieces = _pieces("Let me look. " + CALL + CALL.replace("Paris", "Lyon"), 4)
    reasoning, content, calls, finish = _stream(client, messages=CHAT, tools=TOOLS,
                                                tool_choice="auto")
    assert finish == "tool_calls" and content == "Let me look."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
    assert all(c["id"] for c in calls.values()) and calls[0]["id"] != calls[1]["id"]
    _, _, first_only, _ = _stream(client, messages=CHAT, tools=TOOLS, parallel_tool_calls=False)
    assert len(first_only) == 1


def test_tool_choice_none_leaves_the_text_alone(client, engine):
    engine.pieces = _pieces(CALL)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_a_conversation_with_calls_and_tool_results_is_rendered(client, engine):
    engine.pieces = ["It is sunny."]
    history = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in \
        engine.prompts[-1]
    assert "sunny, 21 C" in engine.prompts[-1]


def test_tool_call_arguments_that_are_not_json_are_400(server):
    history = CHAT + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": history})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages.1.tool_calls.0.function.arguments"


def test_named_tool_choice_asks_for_the_arguments_schema(client, engine):
    engine.pieces = _pieces('{"city": "Paris"}', 3)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=choice)
    assert engine.received[-1].structured_outputs.json == TOOLS[0]["function"]["parameters"]
    [call] = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    _, content, calls, finish = _stream(client, messages=CHAT, tools=TOOLS, tool_choice=choice)
    assert content == "" and finish == "stop"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_weather", '{"city": "Paris"}')]


def test_a_call_forced_by_name_finishes_with_stop_as_in_openai(client, engine):
    engine.pieces = _pieces('{"city": "Oslo"}', 4)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=choice)
    assert r.choices[0].finish_reason == "stop" and len(r.choices[0].message.tool_calls) == 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS,
                                                 tool_choice=choice, stream=True))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and finishes[:-1] == [None] * (len(finishes) - 1)


def test_auto_and_required_calls_finish_with_tool_calls(client, engine):
    engine.pieces = _pieces(CALL, 6)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="auto")
    assert r.choices[0].message.tool_calls and r.choices[0].finish_reason == "tool_calls"
    assert _stream(client, messages=CHAT, tools=TOOLS, tool_choice="auto")[3] == "tool_calls"
    engine.pieces = _pieces('[{"name": "get_weather", "parameters": {"city": "Rome"}}]', 5)
    assert _stream(client, messages=CHAT, tools=TOOLS, tool_choice="required")[3] == "tool_calls"


def test_a_forced_call_cut_by_max_tokens_finishes_with_length(client, engine):
    engine.pieces = _pieces('{"city": "Paris"}', 2)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=choice,
                                       max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert _stream(client, messages=CHAT, tools=TOOLS, tool_choice=choice, max_tokens=3)[3] == \
        "length"


def test_required_tool_choice_asks_for_an_array_of_calls(client, engine):
    engine.pieces = _pieces('[{"name": "get_weather", "parameters": {"city": "Lyon"}}]', 3)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False)
    schema = engine.received[-1].structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["items"]["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    [call] = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Lyon"}
    assert r.choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_needs_the_server_flags():
    with RunningServer(CannedEngine()) as s:
        r = httpx.post(s.base_url + "/v1/chat/completions", json={"messages": CHAT, "tools": TOOLS})
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = httpx.post(s.base_url + "/v1/chat/completions",
                       json={"messages": CHAT, "tools": TOOLS, "tool_choice": "none"})
        assert r.status_code == 200, r.text


def test_streamed_token_ids_include_tokens_the_parsers_hold_back(client, engine, monkeypatch):
    engine.pieces = _pieces("<think>Why.</think>\n" + CALL, 4)
    step = engine.step

    def slow_step():
        time.sleep(0.005)  # NOTE: one piece per chunk, so held-back pieces make chunks of their own
        return step()
    monkeypatch.setattr(engine, "step", slow_step)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS,
                                                 stream=True,
                                                 extra_body={"return_token_ids": True}))
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    assert ids == [engine.cycle[0]] * len(engine.pieces)
    assert chunks[0].model_extra["prompt_token_ids"]


def test_include_reasoning_false_with_token_ids_is_400(server):
    r = httpx.post(server.base_url + "/v1/chat/completions", json={
        "messages": CHAT, "include_reasoning": False, "return_token_ids": True})
    assert r.status_code == 400 and "return_token_ids" in r.json()["error"]["message"]
