"""vLLM's request extras: request_id (and X-Request-Id), return_tokens_as_token_ids,
spaces_between_special_tokens, cache_salt, truncation_side, documents; the vLLM fields still
refused are named with a reason."""
from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

from fake_engine import FakeEngine
from server_utils import RunningServer
from test_errors import MODEL, _assert_error

from peregrine.entrypoints.openai.protocol import MAX_REQUEST_ID_CHARS, UNSUPPORTED_FIELDS
from peregrine.sampling_params import MAX_CACHE_SALT_CHARS

_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
_BOTH = [_COMPLETIONS, _CHAT]
_PREFIX = {_COMPLETIONS: "cmpl", _CHAT: "chatcmpl"}
_DOCS_TEMPLATE = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                  "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")


class RecordingEngine(FakeEngine):
    """Remembers each request's engine id and decoded prompt."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.tokenizer.chat_template = _DOCS_TEMPLATE
        self.added: list[tuple[str, str]] = []

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0) -> None:
        super().add_request(request_id, prompt, params, arrival_time, priority)
        self.added.append((request_id, self.tokenizer.decode(self.waiting[-1].prompt_ids)))


@pytest.fixture(scope="module")
def engine():
    return RecordingEngine(max_model_len=256, step_delay=0.002)


@pytest.fixture(scope="module")
def server(engine):
    with RunningServer(engine) as s:
        yield s


def _body(path: str, **fields) -> dict:
    body = {"model": MODEL, "max_tokens": 3, **fields}
    body.setdefault("messages" if path == _CHAT else "prompt",
                    [{"role": "user", "content": "hi"}] if path == _CHAT else "hi")
    return body


def _post(server, path: str, headers: dict | None = None, **fields) -> httpx.Response:
    return httpx.post(server.base_url + path, json=_body(path, **fields), headers=headers,
                      timeout=30)


def _events(resp: httpx.Response) -> list[dict]:
    assert resp.status_code == 200, resp.text
    lines = [ln[6:] for ln in resp.text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


# ----------------------------------------------------------------------------- request ids
@pytest.mark.parametrize("path", _BOTH)
def test_request_id_is_the_response_ids_suffix(server, engine, path):
    r = _post(server, path, request_id="trace-17")
    assert r.status_code == 200, r.text
    assert r.json()["id"] == f"{_PREFIX[path]}-trace-17"
    # NOTE: the engine's id adds a random suffix, so equal ids never collide there.
    assert re.fullmatch(rf"{_PREFIX[path]}-trace-17-[0-9a-f]{{16}}(-0)?", engine.added[-1][0])
    chunks = _events(_post(server, path, request_id="trace-18", stream=True))
    assert {c["id"] for c in chunks} == {f"{_PREFIX[path]}-trace-18"}


@pytest.mark.parametrize("path", _BOTH)
def test_x_request_id_header_wins_over_the_field(server, path):
    r = _post(server, path, headers={"X-Request-Id": "from-header"}, request_id="from-body")
    assert r.json()["id"] == f"{_PREFIX[path]}-from-header"
    assert _post(server, path, headers={"x-request-id": "lower"}).json()["id"] == \
        f"{_PREFIX[path]}-lower"


def test_without_an_id_each_response_gets_a_random_one(server):
    ids = {_post(server, _CHAT).json()["id"] for _ in range(3)}
    assert len(ids) == 3 and all(re.fullmatch(r"chatcmpl-[0-9a-f]{32}", i) for i in ids)


@pytest.mark.parametrize("value", ["", "x" * (MAX_REQUEST_ID_CHARS + 1), "a\nb", "tab\there"])
def test_bad_request_ids_are_400_naming_the_field(server, value):
    _assert_error(_post(server, _CHAT, request_id=value), 400, "request_id")


def test_bad_request_id_header_is_400_naming_the_header(server):
    r = _post(server, _COMPLETIONS, headers={"X-Request-Id": "y" * (MAX_REQUEST_ID_CHARS + 1)})
    _assert_error(r, 400, "X-Request-Id")
    _assert_error(_post(server, _COMPLETIONS, request_id=7), 400, "request_id")


def test_requests_sharing_an_id_run_side_by_side_without_crossing(server):
    results: dict[int, httpx.Response] = {}

    def run(k: int) -> None:
        stream = {"stream": True, "stream_options": {"include_usage": True}} if k % 2 else {}
        results[k] = _post(server, _COMPLETIONS, request_id="same", max_tokens=20 + k, **stream)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, resp in results.items():
        if k % 2:
            chunks = _events(resp)
            text = "".join(ch["text"] for c in chunks for ch in c["choices"])
            usage = chunks[-1]["usage"]["completion_tokens"]
            assert {c["id"] for c in chunks} == {"cmpl-same"}
        else:
            assert resp.status_code == 200, resp.text
            body = resp.json()
            text, usage = body["choices"][0]["text"], body["usage"]["completion_tokens"]
            assert body["id"] == "cmpl-same"
        # NOTE: every fake token is one character: a stream fed another's tokens would show it.
        assert len(text) == usage == 20 + k


def test_a_client_leaving_does_not_abort_another_request_with_its_id(server, engine):
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.base_url + _CHAT,
                           json=_body(_CHAT, request_id="shared", max_tokens=200,
                                      stream=True)) as first:
            lines = first.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it is running
            other = _post(server, _CHAT, request_id="shared", max_tokens=40)
            # NOTE: the first stream is closed here, mid-answer: its abort must hit only itself.
    assert other.status_code == 200, other.text
    body = other.json()
    assert body["id"] == "chatcmpl-shared" and body["usage"]["completion_tokens"] == 40
    assert body["choices"][0]["finish_reason"] == "length"


# ----------------------------------------------------------------------------- token ids as names
def test_completion_logprobs_name_tokens_by_id(server, engine):
    r = _post(server, _COMPLETIONS, logprobs=2, return_tokens_as_token_ids=True)
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    ids = engine.cycle[:3]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert [list(top) for top in lp["top_logprobs"]] == [[f"token_id:{t}", "token_id:102"]
                                                         for t in ids]
    # NOTE: offsets still count characters of the text, not of the names.
    assert lp["text_offset"] == [0, 1, 2] and choice["text"] == "abc"


def test_streamed_completion_logprobs_name_tokens_by_id(server, engine):
    chunks = _events(_post(server, _COMPLETIONS, logprobs=1, stream=True,
                           return_tokens_as_token_ids=True))
    tokens = [t for c in chunks for ch in c["choices"] for t in ch["logprobs"]["tokens"]]
    assert tokens == [f"token_id:{t}" for t in engine.cycle[:3]]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_name_tokens_by_id(server, engine, stream):
    r = _post(server, _CHAT, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True,
              stream=stream)
    if stream:
        rows = [row for c in _events(r) for ch in c["choices"]
                for row in (ch.get("logprobs") or {}).get("content") or []]
    else:
        rows = r.json()["choices"][0]["logprobs"]["content"]
    names = [f"token_id:{t}" for t in engine.cycle[:3]]
    assert [row["token"] for row in rows] == names
    assert [row["bytes"] for row in rows] == [list(n.encode()) for n in names]
    assert [[top["token"] for top in row["top_logprobs"]] for row in rows] == [
        [n, "token_id:102"] for n in names]


def test_logprobs_keep_token_text_by_default(server):
    lp = _post(server, _COMPLETIONS, logprobs=1).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"]


# ----------------------------------------------------------------------------- fields reaching the engine
@pytest.mark.parametrize("path", _BOTH)
def test_spaces_and_salt_reach_the_engine(server, engine, path):
    assert _post(server, path, skip_special_tokens=False, spaces_between_special_tokens=False,
                 cache_salt="tenant-1").status_code == 200
    params = engine.received[-1]
    assert params.spaces_between_special_tokens is False and params.skip_special_tokens is False
    assert params.cache_salt == "tenant-1"
    _post(server, path)
    assert engine.received[-1].spaces_between_special_tokens is True
    assert engine.received[-1].cache_salt is None


@pytest.mark.parametrize("value,param", [("", "cache_salt"), ("s" * (MAX_CACHE_SALT_CHARS + 1),
                                                              "cache_salt"),
                                         (5, "cache_salt"), ("no", "spaces_between_special_tokens"),
                                         (1, "return_tokens_as_token_ids")])
def test_malformed_extras_are_400_naming_them(server, value, param):
    _assert_error(_post(server, _CHAT, **{param: value}), 400, param)


@pytest.mark.parametrize("side,kept", [(None, [7, 8]), ("left", [7, 8]), ("right", [5, 6])])
def test_truncation_side_picks_the_end_that_is_kept(server, engine, side, kept):
    fields = {"truncation_side": side} if side else {}
    r = _post(server, _COMPLETIONS, prompt=[5, 6, 7, 8], truncate_prompt_tokens=2, echo=True,
              **fields)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 2
    assert engine.added[-1][1] == engine.tokenizer.decode(kept)


def test_truncation_side_without_truncation_is_400(server):
    _assert_error(_post(server, _CHAT, truncation_side="right"), 400, "truncation_side")
    _assert_error(_post(server, _CHAT, truncation_side="middle", truncate_prompt_tokens=2), 400,
                  "truncation_side")


def test_documents_reach_the_chat_template(server, engine):
    docs = [{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]
    assert _post(server, _CHAT, documents=docs).status_code == 200
    assert engine.added[-1][1] == "[A: alpha][B: beta]user: hi\n"
    assert _post(server, _CHAT).status_code == 200
    assert engine.added[-1][1] == "user: hi\n"


@pytest.mark.parametrize("docs", [{"title": "A"}, [{"title": 1}], ["text"]])
def test_malformed_documents_are_400(server, docs):
    err = _assert_error(_post(server, _CHAT, documents=docs), 400)
    assert err["param"].startswith("documents")


def test_documents_are_a_chat_field(server):
    err = _assert_error(_post(server, _COMPLETIONS, documents=[]), 400, "documents")
    assert err["message"].startswith("Unrecognized request argument")


# ----------------------------------------------------------------------------- still refused
_REFUSED = [("echo", True), ("watermarking", True), ("logprob_token_ids", [5]),
            ("thinking_token_budget", 10), ("repetition_detection", {}), ("stream_interval", 2),
            ("session_id", "s"), ("kv_transfer_params", {}), ("vllm_xargs", {"a": 1}),
            ("media_io_kwargs", {})]


@pytest.mark.parametrize("field,value", _REFUSED)
def test_vllm_extras_not_implemented_are_refused_with_the_reason(server, field, value):
    err = _assert_error(_post(server, _CHAT, **{field: value}), 400, field)
    assert err["message"] == f"{field} is not supported: {UNSUPPORTED_FIELDS[field]}"


def test_echo_is_still_a_completions_field(server):
    r = _post(server, _COMPLETIONS, echo=True, prompt="hi")
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("hi")


# ----------------------------------------------------------------------------- cache_salt, real engine
def test_cache_salt_separates_prefix_cache_hits_through_the_server(real_server):
    prompt = [(3 + 11 * i) % 400 + 7 for i in range(40)]  # two full 16-token blocks and 8 more

    def cached(salt: str) -> int:
        r = httpx.post(real_server.base_url + _COMPLETIONS, timeout=60,
                       json={"prompt": prompt, "max_tokens": 1, "cache_salt": salt})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    salt = f"salt-{id(prompt)}"
    assert cached(salt) == 0
    assert cached(salt) == 32
    assert cached(salt + "-other") == 0
    assert cached(salt + "-other") == 32


# ----------------------------------------------------------------------------- return_token_ids
def test_completion_returns_prompt_and_generated_token_ids(server, engine):
    body = _post(server, _COMPLETIONS, prompt=[5, 6, 7], n=2, return_token_ids=True).json()
    for choice in body["choices"]:
        assert choice["prompt_token_ids"] == [5, 6, 7]
        assert choice["token_ids"] == [engine.cycle[(i + choice["index"]) % len(engine.cycle)]
                                       for i in range(3)]
    plain = _post(server, _COMPLETIONS, prompt=[5, 6, 7]).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None


def test_streamed_completion_returns_the_prompt_ids_once_then_deltas(server, engine):
    chunks = _events(_post(server, _COMPLETIONS, prompt=["ab", "cd"], return_token_ids=True,
                           stream=True))
    for index, text in enumerate(["ab", "cd"]):
        prompt_ids = engine.tokenizer.encode(text)
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == index]
        assert [ch["prompt_token_ids"] for ch in mine] == [prompt_ids] + [None] * (len(mine) - 1)
        assert [t for ch in mine for t in ch["token_ids"]] == engine.cycle[:3]
    plain = _events(_post(server, _COMPLETIONS, stream=True))
    assert all("token_ids" not in ch and "prompt_token_ids" not in ch
               for c in plain for ch in c["choices"])


def test_chat_returns_prompt_and_generated_token_ids(server, engine):
    body = _post(server, _CHAT, return_token_ids=True).json()
    assert body["prompt_token_ids"] == engine.tokenizer.encode("user: hi\n",
                                                               add_special_tokens=False)
    assert body["choices"][0]["token_ids"] == engine.cycle[:3]
    chunks = _events(_post(server, _CHAT, return_token_ids=True, stream=True))
    assert chunks[0]["prompt_token_ids"] == body["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == engine.cycle[:3]
    plain = _events(_post(server, _CHAT, stream=True))
    assert all("token_ids" not in ch for c in plain for ch in c["choices"])
