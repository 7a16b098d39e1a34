"""response_format, vLLM's structured_outputs and forced tool calls (tool_choice "required" or
a named function) through the server onto the engine's constrained decoding (tiny llama)."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from fake_engine import FakeEngine
from server_utils import TINY_MODEL_NAME as MODEL
from server_utils import RunningServer
from peregrine.structured_output.params import StructuredOutputsParams

pytest.importorskip("xgrammar")

CHAT = [{"role": "user", "content": "Weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC"]}}, "required": ["tz"],
             "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", max_retries=0)


def test_response_format_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, seed=1,
                                       response_format=fmt)
    assert json.loads(r.choices[0].message.content)["city"] in ("Paris", "Lyon")
    c = client.completions.create(model=MODEL, prompt="Weather:", max_tokens=32, seed=2,
                                  extra_body={"response_format": fmt})
    assert json.loads(c.choices[0].text)["city"] in ("Paris", "Lyon")


def test_response_format_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=48, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("so,check", [
    ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"regex": "[a-c]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[a-c]{3}-[0-9]{2}", t)),
])
def test_vllm_structured_outputs_field(client, so, check):
    r = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=16, seed=3,
                                  extra_body={"structured_outputs": so})
    assert check(r.choices[0].text), r.choices[0].text


def test_a_spec_that_does_not_compile_is_400(real_server):
    r = httpx.post(real_server.base_url + "/v1/completions",
                   json={"prompt": "x", "structured_outputs": {"regex": "(unclosed"}})
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"]


def test_named_tool_choice_forces_that_call(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=32,
                                       tool_choice=choice, seed=4)
    [call] = r.choices[0].message.tool_calls
    # NOTE: OpenAI ends a call forced by name with "stop" ("tool_calls" is for auto / required).
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "stop"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Lyon")
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS,
                                                 max_tokens=32, tool_choice=choice, seed=4,
                                                 stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_required_tool_choice_makes_at_least_one_call(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=64,
                                       tool_choice="required", parallel_tool_calls=False, seed=5)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    assert calls[0].function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(calls[0].function.arguments), dict)


# ----------------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def fake():
    with RunningServer(FakeEngine(max_model_len=64)) as s:
        yield s


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", json={"messages": CHAT, **body})


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, None),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_bad_structure_requests_are_400(fake, body, param):
    r = _post(fake, body)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.json()


def test_requests_map_onto_structured_outputs_params(fake):
    engine = fake.async_engine.engine
    cases = [({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
             ({"response_format": {"type": "json_schema", "json_schema": {"schema": CITY}}},
              StructuredOutputsParams(json=CITY)),
             ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=["a", "b"])),
             ({"response_format": {"type": "text"}}, None)]
    for body, expected in cases:
        assert _post(fake, {"max_tokens": 2, **body}).status_code == 200
        assert engine.received[-1].structured_outputs == expected
