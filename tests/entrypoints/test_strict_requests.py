"""Loose values are 400s naming the field: strict booleans and integers, finite bounded floats,
ASCII token-id keys, in-vocabulary stop token ids, and a cap on n."""
from __future__ import annotations

import json

import httpx
import pytest

from fake_engine import FakeEngine
from server_utils import RunningServer
from test_errors import MODEL, _assert_error, _still_serving

from peregrine.entrypoints.openai.protocol import MAX_N
from peregrine.sampling_params import MAX_TEMPERATURE, SamplingParams

_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
_MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with RunningServer(FakeEngine(max_model_len=64)) as s:
        yield s


def _post(server, path: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 2, **fields}
    body.setdefault("messages" if path == _CHAT else "prompt", _MESSAGES if path == _CHAT else "hi")
    # NOTE: NaN and Infinity go out as the bare tokens Python's json writes (and reads back).
    return httpx.post(server.base_url + path, content=json.dumps(body, allow_nan=True),
                      headers={"Content-Type": "application/json"}, timeout=30)


@pytest.mark.parametrize("path,field,value", [
    (_COMPLETIONS, "stream", "yes"),
    (_COMPLETIONS, "stream", 1),
    (_CHAT, "stream", "true"),
    (_COMPLETIONS, "echo", "yes"),
    (_CHAT, "logprobs", "yes"),
    (_COMPLETIONS, "ignore_eos", 1),
    (_CHAT, "skip_special_tokens", "false"),
    (_COMPLETIONS, "include_stop_str_in_output", "true"),
    (_CHAT, "add_generation_prompt", 0),
])
def test_non_boolean_flags_are_400_naming_the_field(server, path, field, value):
    _assert_error(_post(server, path, **{field: value}), 400, field)


@pytest.mark.parametrize("path", [_COMPLETIONS, _CHAT])
def test_non_boolean_include_usage_is_400_naming_it(server, path):
    r = _post(server, path, stream=True, stream_options={"include_usage": "yes"})
    _assert_error(r, 400, "stream_options.include_usage")


@pytest.mark.parametrize("field,value", [("n", "2"), ("max_tokens", "4"), ("seed", "7"),
                                         ("top_k", 2.0)])
def test_integers_given_as_strings_or_floats_are_400(server, field, value):
    _assert_error(_post(server, _COMPLETIONS, **{field: value}), 400, field)


@pytest.mark.parametrize("path", [_COMPLETIONS, _CHAT])
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_floats_are_400_naming_the_field(server, path, field, value):
    _assert_error(_post(server, path, **{field: value}), 400, field)


def test_non_finite_logit_bias_value_is_400(server):
    err = _assert_error(_post(server, _COMPLETIONS, logit_bias={"5": float("nan")}), 400)
    assert err["param"].startswith("logit_bias")


@pytest.mark.parametrize("value", [1e308, MAX_TEMPERATURE * 1.01])
def test_temperature_over_the_cap_is_400_saying_the_cap(server, value):
    err = _assert_error(_post(server, _CHAT, temperature=value), 400, "temperature")
    assert f"{MAX_TEMPERATURE:g}" in err["message"]
    _still_serving(server.base_url)


def test_sampling_params_refuse_temperature_over_the_cap():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=MAX_TEMPERATURE * 2)


@pytest.mark.parametrize("key", ["\u0663", "1_0", " 5", "5 ", "+5", "5\n", "", "1" * 13])
def test_logit_bias_keys_must_be_ascii_digits(server, key):
    _assert_error(_post(server, _COMPLETIONS, logit_bias={key: 1.0}), 400, "logit_bias")


def test_logit_bias_ascii_key_in_vocabulary_is_served(server):
    assert _post(server, _COMPLETIONS, logit_bias={"5": 1.0}).status_code == 200


@pytest.mark.parametrize("path", [_COMPLETIONS, _CHAT])
@pytest.mark.parametrize("ids", [[2 ** 70], [5, 10 ** 9], [-1]])
def test_stop_token_ids_outside_the_vocabulary_are_400(server, path, ids):
    _assert_error(_post(server, path, stop_token_ids=ids), 400, "stop_token_ids")
    _still_serving(server.base_url)


@pytest.mark.parametrize("path", [_COMPLETIONS, _CHAT])
def test_n_over_the_cap_is_400_naming_n(server, path):
    err = _assert_error(_post(server, path, n=MAX_N + 1), 400, "n")
    assert str(MAX_N) in err["message"]


def test_n_at_the_cap_with_chat_default_max_tokens_runs_every_choice_to_the_context(server):
    # NOTE: chat's unset max_tokens is the rest of the context for each of the n choices.
    body = {"model": MODEL, "messages": _MESSAGES, "n": MAX_N, "ignore_eos": True}
    r = httpx.post(server.base_url + _CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["finish_reason"] for c in data["choices"]] == ["length"] * MAX_N
    assert data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"] // MAX_N == 64
