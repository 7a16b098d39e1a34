"""Request fields the server does not implement are 400s naming them (never a 200 with the field
dropped); OpenAI's metadata fields are accepted and ignored; allowed_token_ids and bad_words reach
the engine; OpenAI's limits hold unless --relax-openai-limits; bodies must be sent as JSON."""
from __future__ import annotations

import httpx
import pytest

from fake_engine import FakeEngine
from server_utils import RunningServer
from test_errors import MODEL, _assert_error, _still_serving

from peregrine.entrypoints.openai.protocol import (OPENAI_MAX_STOP_STRINGS,
                                                   OPENAI_MAX_TEMPERATURE, UNSUPPORTED_FIELDS)
from peregrine.sampling_params import MAX_STOP_STRINGS, MAX_TEMPERATURE

_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
_MESSAGES = [{"role": "user", "content": "hi"}]
_BOTH = [_COMPLETIONS, _CHAT]
_RELAX = "--relax-openai-limits"


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(max_model_len=64)


@pytest.fixture(scope="module")
def server(engine):
    with RunningServer(engine) as s:
        yield s


@pytest.fixture(scope="module")
def relaxed():
    with RunningServer(FakeEngine(max_model_len=64), relax_openai_limits=True) as s:
        yield s


def _body(path: str, **fields) -> dict:
    body = {"model": MODEL, "max_tokens": 2, **fields}
    body.setdefault("messages" if path == _CHAT else "prompt", _MESSAGES if path == _CHAT else "hi")
    return body


def _post(server, path: str, **fields) -> httpx.Response:
    return httpx.post(server.base_url + path, json=_body(path, **fields), timeout=30)


def _refused(resp: httpx.Response, param: str) -> str:
    """The message of a 400 that names `param`."""
    err = _assert_error(resp, 400, param)
    assert param in err["message"], err
    return err["message"]


# ----------------------------------------------------------------------------- unsupported fields
_VLLM_AND_OPENAI_FIELDS = [
    ("guided_json", {"type": "object"}), ("guided_choice", ["yes", "no"]),
    ("guided_regex", "[a-z]+"), ("guided_grammar", "root ::= 'a'"),
    ("structural_tag", {"type": "structural_tag"}), ("use_beam_search", True),
    ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"),
    ("audio", {"voice": "alloy"}),
]


@pytest.mark.parametrize("path", _BOTH)
@pytest.mark.parametrize("field,value", _VLLM_AND_OPENAI_FIELDS)
def test_fields_the_server_does_not_implement_are_refused_by_name(server, path, field, value):
    message = _refused(_post(server, path, **{field: value}), field)
    assert UNSUPPORTED_FIELDS[field] in message


def test_tools_without_a_tool_call_parser_need_tool_choice_none(server):
    tools = [{"type": "function", "function": {"name": "f"}}]
    message = _refused(_post(server, _CHAT, tools=tools), "tool_choice")
    assert "--enable-auto-tool-choice" in message
    assert _post(server, _CHAT, tools=tools, tool_choice="none").status_code == 200


def test_tools_are_a_chat_field(server):
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert _refused(_post(server, "/v1/completions", tools=tools), "tools").startswith(
        "Unrecognized request argument")


def test_tool_choice_without_tools_is_an_error_of_its_own(server):
    message = _refused(_post(server, _CHAT, tool_choice="auto"), "tool_choice")
    assert "only valid together with tools" in message


def test_a_tool_without_a_function_is_named(server):
    _assert_error(_post(server, _CHAT, tool_choice="auto", tools=[{"type": "function"}]), 400,
                  "tools.0.function")


@pytest.mark.parametrize("path", _BOTH)
@pytest.mark.parametrize("field", ["frobnicate", "temprature", "guided_json_object"])
def test_unknown_fields_are_refused_as_openai_does(server, path, field):
    message = _refused(_post(server, path, **{field: 1}), field)
    assert message == f"Unrecognized request argument supplied: {field}"


@pytest.mark.parametrize("field", ["", "a-b", "x[1]", "t\u00e9mp"])
def test_unknown_fields_with_any_characters_are_named_as_sent(server, field):
    assert _refused(_post(server, _CHAT, **{field: 1}), field).endswith(f": {field}")


def test_a_long_unknown_field_name_is_shortened_in_the_answer(server):
    err = _assert_error(_post(server, _CHAT, **{"y" * 5000: 1}), 400)
    assert err["param"] == "y" * 100 and len(err["message"]) < 200


def test_an_unknown_field_is_named_before_other_errors(server):
    _refused(_post(server, _COMPLETIONS, temperature=-1, frobnicate=1), "frobnicate")


def test_unknown_field_inside_stream_options_is_named_with_its_path(server):
    r = _post(server, _COMPLETIONS, stream=True, stream_options={"include_usage": True, "x": 1})
    assert "stream_options.x" in _refused(r, "stream_options.x")


def test_unknown_fields_of_the_tokenizer_routes_are_refused(server):
    r = httpx.post(server.base_url + "/tokenize", json={"prompt": "hi", "max_tokens": 2})
    _refused(r, "max_tokens")
    r = httpx.post(server.base_url + "/detokenize", json={"tokens": [5], "skip": True})
    _refused(r, "skip")


@pytest.mark.parametrize("path", _BOTH)
@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "text", "extra": 1}, "response_format.extra"), ({}, "response_format.type"),
    ({"type": "grammar"}, "response_format.type")])
def test_malformed_response_format_is_refused(server, path, fmt, param):
    _assert_error(_post(server, path, response_format=fmt), 400, param)


@pytest.mark.parametrize("path", _BOTH)
def test_response_format_text_is_served(server, path):
    assert _post(server, path, response_format={"type": "text"}).status_code == 200


@pytest.mark.parametrize("modalities", [["text", "audio"], ["audio"], []])
def test_modalities_other_than_text_are_refused(server, modalities):
    _refused(_post(server, _CHAT, modalities=modalities), "modalities")


def test_text_modality_is_served(server):
    assert _post(server, _CHAT, modalities=["text"]).status_code == 200


@pytest.mark.parametrize("path", _BOTH)
@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_streaming_are_refused(server, path, stream):
    fields = {"stream_options": {"include_usage": True}}
    if stream is not None:
        fields["stream"] = stream
    message = _refused(_post(server, path, **fields), "stream_options")
    assert "stream: true" in message


@pytest.mark.parametrize("path", _BOTH)
def test_openai_metadata_fields_are_accepted_and_ignored(server, path):
    r = _post(server, path, user="u-1", metadata={"team": "a"}, store=False,
              service_tier="auto")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("field,value", [("metadata", {"k": 1}), ("store", "yes"),
                                         ("service_tier", 3)])
def test_metadata_fields_of_the_wrong_type_are_400(server, field, value):
    assert _post(server, _CHAT, **{field: value}).json()["error"]["param"].startswith(field)


def test_every_implemented_field_is_still_served(server):
    chat = _post(server, _CHAT, n=2, temperature=0.5, top_p=0.9, top_k=5, min_p=0.01, seed=3,
                 presence_penalty=0.1, frequency_penalty=0.1, repetition_penalty=1.1,
                 stop=["zz"], stop_token_ids=[5], ignore_eos=True, min_tokens=1,
                 include_stop_str_in_output=True, skip_special_tokens=False, priority=0,
                 truncate_prompt_tokens=8, prompt_logprobs=1, logit_bias={"5": 1.0},
                 best_of=2, logprobs=True, top_logprobs=2, max_completion_tokens=2,
                 add_generation_prompt=True, continue_final_message=False,
                 chat_template_kwargs={"x": 1}, allowed_token_ids=[5, 6], bad_words=["qq"],
                 stream=False)
    assert chat.status_code == 200, chat.text
    completion = _post(server, _COMPLETIONS, echo=True, logprobs=1, suffix="")
    assert completion.status_code == 200, completion.text
    streamed = _post(server, _COMPLETIONS, stream=True,
                     stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")


# ------------------------------------------------------------------------- allowed ids, bad words
@pytest.mark.parametrize("path", _BOTH)
def test_allowed_token_ids_and_bad_words_reach_the_engine(server, engine, path):
    r = _post(server, path, allowed_token_ids=[7, 9, 11], bad_words=["foo", "bar baz"])
    assert r.status_code == 200, r.text
    params = engine.received[-1]
    assert params.allowed_token_ids == [7, 9, 11]
    assert params.bad_words == ["foo", "bar baz"]


def test_requests_without_them_send_none(server, engine):
    assert _post(server, _COMPLETIONS).status_code == 200
    assert (engine.received[-1].allowed_token_ids, engine.received[-1].bad_words) == (None, None)


@pytest.mark.parametrize("ids", [[10 ** 9], [5, -1]])
def test_allowed_token_ids_outside_the_vocabulary_are_400(server, ids):
    message = _refused(_post(server, _COMPLETIONS, allowed_token_ids=ids), "allowed_token_ids")
    assert "vocabulary" in message
    _still_serving(server.base_url)


def test_bad_words_without_a_tokenizer_are_400_naming_them(tiny_model_path):
    from peregrine.config import EngineArgs
    from peregrine.engine.async_engine import AsyncEngine
    args = EngineArgs(model=tiny_model_path, device="cpu", skip_tokenizer_init=True,
                      max_model_len=64, num_gpu_blocks_override=32, served_model_name=MODEL)
    with RunningServer(AsyncEngine.from_engine_args(args)) as s:
        r = _post(s, _COMPLETIONS, prompt=[5, 6], bad_words=["foo"])
        assert "tokenizer" in _refused(r, "bad_words")


@pytest.mark.parametrize("field,value", [("allowed_token_ids", []), ("allowed_token_ids", ["5"]),
                                         ("bad_words", [""]), ("bad_words", [5]),
                                         ("bad_words", "foo")])
def test_malformed_allowed_token_ids_and_bad_words_are_400(server, field, value):
    assert _post(server, _CHAT, **{field: value}).json()["error"]["param"].startswith(field)


# ----------------------------------------------------------------------------- OpenAI's limits
@pytest.mark.parametrize("path", _BOTH)
@pytest.mark.parametrize("value", [OPENAI_MAX_TEMPERATURE + 1e-6, 50.0, 1e308])
def test_temperature_over_openais_limit_is_400_naming_limit_and_flag(server, path, value):
    message = _refused(_post(server, path, temperature=value), "temperature")
    assert f"[0, {OPENAI_MAX_TEMPERATURE:g}]" in message and _RELAX in message


def test_temperature_at_openais_limit_is_served(server):
    assert _post(server, _COMPLETIONS, temperature=OPENAI_MAX_TEMPERATURE).status_code == 200


@pytest.mark.parametrize("path", _BOTH)
def test_more_stop_strings_than_openai_allows_are_400_naming_limit_and_flag(server, path):
    stop = [f"s{i}" for i in range(OPENAI_MAX_STOP_STRINGS + 1)]
    message = _refused(_post(server, path, stop=stop), "stop")
    assert str(OPENAI_MAX_STOP_STRINGS) in message and _RELAX in message


def test_openais_number_of_stop_strings_is_served(server):
    stop = [f"s{i}" for i in range(OPENAI_MAX_STOP_STRINGS)]
    assert _post(server, _COMPLETIONS, stop=stop).status_code == 200


def test_relaxed_server_takes_the_engines_bounds(relaxed):
    assert _post(relaxed, _CHAT, temperature=MAX_TEMPERATURE).status_code == 200
    stop = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert _post(relaxed, _COMPLETIONS, stop=stop).status_code == 200


def test_relaxed_server_still_refuses_past_the_engines_bounds(relaxed):
    message = _refused(_post(relaxed, _CHAT, temperature=MAX_TEMPERATURE * 1.01), "temperature")
    assert f"{MAX_TEMPERATURE:g}" in message
    stop = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    assert str(MAX_STOP_STRINGS) in _refused(_post(relaxed, _COMPLETIONS, stop=stop), "stop")


def test_offline_sampling_params_keep_the_engines_bounds():
    from peregrine.sampling_params import SamplingParams
    params = SamplingParams(temperature=MAX_TEMPERATURE, stop=[f"s{i}" for i in range(10)])
    assert params.temperature == MAX_TEMPERATURE and len(params.stop) == 10


# ----------------------------------------------------------------------------- content type
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize",
                                   "/detokenize"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_400_saying_so(server, route, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = httpx.post(server.base_url + route, content=b'{"prompt": "hi", "tokens": [5]}',
                   headers=headers, timeout=30)
    err = _assert_error(r, 400)
    assert "Content-Type: application/json" in err["message"]
    assert (content_type or "no Content-Type") in err["message"]


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json"])
def test_json_content_types_with_parameters_are_served(server, content_type):
    r = httpx.post(server.base_url + _COMPLETIONS, headers={"Content-Type": content_type},
                   content=b'{"prompt": "hi", "max_tokens": 2}', timeout=30)
    assert r.status_code == 200, r.text
