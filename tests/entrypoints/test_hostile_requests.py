"""No single request may stall the server: request-sent templates, huge prompts, lone surrogates,
the tokenizer endpoints behind the API key, stop-string limits."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from fake_engine import FakeEngine
from server_utils import RunningServer
from peregrine.entrypoints.openai.serving_common import (INLINE_MAX_CHARS, MIN_PROMPT_CHARS,
                                                         prompt_char_limit)
from peregrine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

CHAT = [{"role": "user", "content": "hi"}]
# The reported template: 10^8 loop turns, about 20 s of Jinja on one core.
SLOW_TEMPLATE = ("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}x")
LIMIT = MIN_PROMPT_CHARS  # the fake engine's max_model_len of 64 puts its limit at the floor


class _WatchedTokenizer:
    """Wraps a tokenizer: records which threads call `gated`, and holds them until released."""

    def __init__(self, tok: Any, gated: str = "encode", hold: bool = False) -> None:
        self._tok, self._gated, self._hold = tok, gated, hold
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def _enter(self) -> None:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        if self._hold:
            self.release.wait(10)

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        if self._gated == "encode":
            self._enter()
        return self._tok.encode(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        if self._gated == "apply_chat_template":
            self._enter()
        return self._tok.apply_chat_template(*args, **kwargs)


@pytest.fixture(scope="module")
def server():
    with RunningServer(FakeEngine(max_model_len=64)) as s:
        yield s


@pytest.fixture()
def watched(server):
    """Install a _WatchedTokenizer on the server for one test (call it with its options)."""
    original = server.async_engine.tokenizer
    made: list[_WatchedTokenizer] = []

    def install(**kwargs: Any) -> _WatchedTokenizer:
        made.append(_WatchedTokenizer(original, **kwargs))
        server.async_engine.tokenizer = made[-1]
        return made[-1]

    yield install
    for w in made:
        w.release.set()
    server.async_engine.tokenizer = original


def _post(server, path: str, body: dict | str, **kwargs: Any) -> httpx.Response:
    if isinstance(body, str):
        return httpx.post(server.base_url + path, content=body.encode(), timeout=10,
                          headers={"Content-Type": "application/json", **kwargs.pop("headers", {})},
                          **kwargs)
    return httpx.post(server.base_url + path, json=body, timeout=10, **kwargs)


def _max_tokens(path: str, n: int) -> dict:
    """{"max_tokens": n} for the generation routes; /tokenize refuses the field."""
    return {"max_tokens": n} if path.startswith("/v1/") else {}


def _error(resp: httpx.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    return err


def _health_while(server, pending: Future, bound_s: float = 2.0) -> float:
    """Seconds /health took while `pending` was still in flight."""
    t0 = time.monotonic()
    assert httpx.get(server.base_url + "/health", timeout=bound_s + 3).status_code == 200
    took = time.monotonic() - t0
    assert not pending.done(), "the slow request finished first; nothing was measured"
    return took


# ----------------------------------------------------------------------------- chat templates
@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": SLOW_TEMPLATE}},
     "chat_template_kwargs.chat_template"),
    ("/v1/chat/completions", {"chat_template": SLOW_TEMPLATE}, "chat_template"),
    ("/tokenize", {"chat_template_kwargs": {"chat_template": SLOW_TEMPLATE}},
     "chat_template_kwargs.chat_template"),
    ("/tokenize", {"chat_template": SLOW_TEMPLATE}, "chat_template"),
])
def test_request_chat_template_is_refused_quickly_by_default(server, path, extra, param):
    t0 = time.monotonic()
    err = _error(_post(server, path, {"messages": CHAT, **_max_tokens(path, 2), **extra}), 400,
                 param)
    assert time.monotonic() - t0 < 2.0
    assert "--trust-request-chat-template" in err["message"]


def test_template_kwargs_may_not_override_apply_chat_template_arguments(server):
    r = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                               "chat_template_kwargs": {"tokenize": True}})
    _error(r, 400, "chat_template_kwargs")


def test_trusted_request_chat_template_is_used():
    with RunningServer(FakeEngine(), trust_request_chat_template=True) as s:
        own = _post(s, "/tokenize", {"prompt": "hi!", "add_special_tokens": False}).json()
        for extra in ({"chat_template": "{{ messages[0]['content'] }}!"},
                      {"chat_template_kwargs": {"chat_template": "{{ messages[0]['content'] }}!"}}):
            r = _post(s, "/tokenize", {"messages": CHAT, **extra})
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == own["tokens"]


def test_trusted_slow_template_renders_off_the_event_loop():
    # NOTE: 16 million loop turns: about a second here, several on a slow machine.
    slow = SLOW_TEMPLATE.replace("10000", "4000")
    with RunningServer(FakeEngine(), trust_request_chat_template=True) as s, \
            ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_post, s, "/tokenize", {"messages": CHAT, "chat_template": slow})
        time.sleep(0.2)
        assert _health_while(s, pending) < 1.0
        assert pending.result().json()["tokens"]


# NOTE: just over what runs inline; sent to /tokenize, which does not hold it to the context.
_LONG = " ".join(["hi"] * (INLINE_MAX_CHARS // 3 + 1))
_LONG_CHAT = [{"role": "user", "content": _LONG}]


@pytest.mark.parametrize("gated,path,body", [
    ("encode", "/tokenize", {"prompt": _LONG}),
    ("encode", "/tokenize", {"messages": _LONG_CHAT}),
    ("apply_chat_template", "/tokenize", {"messages": _LONG_CHAT}),
])
def test_large_inputs_are_templated_and_tokenized_in_the_server_thread_pool(server, watched,
                                                                            gated, path, body):
    tok = watched(gated=gated, hold=True)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_post, server, path, body)
        assert tok.entered.wait(10)
        try:
            assert _health_while(server, pending) < 2.0
        finally:
            tok.release.set()
        assert pending.result().status_code == 200, pending.result().text
    assert tok.threads and all(n.startswith("peregrine-preprocess") for n in tok.threads)


@pytest.mark.parametrize("gated,path,body", [
    ("encode", "/v1/completions", {"prompt": "hi there", "max_tokens": 2}),
    ("encode", "/tokenize", {"prompt": "hi there"}),
    ("encode", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    ("apply_chat_template", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    ("apply_chat_template", "/tokenize", {"messages": CHAT}),
])
def test_short_inputs_are_templated_and_tokenized_inline(server, watched, gated, path, body):
    tok = watched(gated=gated)
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    assert tok.threads and not any(n.startswith("peregrine-preprocess") for n in tok.threads)


# ----------------------------------------------------------------------------- prompt length
def test_prompt_char_limit_is_16_per_token_with_a_floor():
    assert prompt_char_limit(64) == MIN_PROMPT_CHARS == 16384
    assert prompt_char_limit(8192) == 16 * 8192
    assert prompt_char_limit(8192, override=100) == 100


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x" * (LIMIT + 1)}, "prompt"),
    ("/v1/completions", {"prompt": ["hi", "x" * (LIMIT + 1)]}, "prompt"),
    ("/tokenize", {"prompt": "x" * (LIMIT + 1)}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * LIMIT}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x" * LIMIT}]}, "messages"),
])
def test_prompt_over_the_char_limit_is_refused_before_tokenizing(server, watched, path, body,
                                                                 param):
    tok = watched(gated="encode")
    err = _error(_post(server, path, {**_max_tokens(path, 2), **body}), 400, param)
    assert str(LIMIT) in err["message"] and "--max-prompt-chars" in err["message"]
    assert tok.threads == []


def test_prompt_at_the_char_limit_is_tokenized(server):
    r = _post(server, "/tokenize", {"prompt": "ab " * (LIMIT // 3)})
    assert r.status_code == 200 and r.json()["count"] > 0


def test_max_prompt_chars_flag_sets_the_limit():
    with RunningServer(FakeEngine(), max_prompt_chars=100) as s:
        assert _post(s, "/tokenize", {"prompt": "x" * 100}).status_code == 200
        err = _error(_post(s, "/tokenize", {"prompt": "x" * 101}), 400, "prompt")
        assert "100" in err["message"]


# ----------------------------------------------------------------------------- API key
def test_tokenize_and_detokenize_need_the_api_key():
    with RunningServer(FakeEngine(), api_key="sekrit") as s:
        good = {"Authorization": "Bearer sekrit"}
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5, 6]})):
            assert _post(s, path, body).status_code == 401
            assert _post(s, path, body, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert _post(s, path, body, headers=good).status_code == 200
        assert httpx.get(s.base_url + "/health").status_code == 200


# ----------------------------------------------------------------------------- UTF-8
@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", r'{"prompt": "\ud800"}', "prompt"),
    ("/v1/completions", r'{"prompt": ["ok", "a\udfffb"]}', "prompt.1"),
    ("/v1/completions", r'{"prompt": "hi", "stop": ["ok", "\ud800"]}', "stop.1"),
    ("/v1/completions", r'{"prompt": "hi", "model": "\udbff"}', "model"),
    ("/v1/completions", r'{"prompt": "hi", "logit_bias": {"\ud800": 1}}', "logit_bias"),
    ("/v1/completions", r'{"prompt": "\ude00\ud83d"}', "prompt"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud800"}]}',
     "messages.0.content"),
    ("/v1/chat/completions",
     r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
     "messages.0.content.0.text"),
    ("/v1/chat/completions",
     r'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": "\ud800"}}',
     "chat_template_kwargs.x"),
    ("/tokenize", r'{"prompt": "\ud800"}', "prompt"),
    ("/tokenize", r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages.0.content"),
    ("/detokenize", r'{"tokens": [5], "model": "\ud800"}', "model"),
])
def test_lone_surrogate_is_400_naming_the_field(server, path, raw, param):
    err = _error(_post(server, path, raw), 400, param)
    assert "UTF-8" in err["message"]
    assert _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_surrogate_pair_escapes_are_fine(server):
    r = _post(server, "/v1/completions", r'{"prompt": "\ud83d\ude00 hi", "max_tokens": 2}')
    assert r.status_code == 200, r.text


def test_raw_bytes_that_are_not_utf8_are_400(server):
    r = httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": "\xed\xa0\x80"}',
                   headers={"Content-Type": "application/json"}, timeout=10)
    _error(r, 400, "prompt")


# ----------------------------------------------------------------------------- stop strings
@pytest.mark.parametrize("stop", [
    [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)],
    "x" * (MAX_STOP_STRING_CHARS + 1),
])
def test_stop_strings_over_the_limits_are_400(server, stop):
    _error(_post(server, "/v1/completions", {"prompt": "hi", "stop": stop}), 400, "stop")
