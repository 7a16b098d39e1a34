"""Every bad input gets its status and OpenAI's error shape, and the server keeps serving."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from fake_engine import FakeEngine
from server_utils import RunningServer

MODEL = "fake-model"


@pytest.fixture(scope="module")
def server():
    with RunningServer(FakeEngine(max_model_len=64), max_request_body_bytes=4096) as s:
        yield s


def _assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def _still_serving(base_url: str, headers: dict | None = None) -> None:
    r = httpx.post(base_url + "/v1/completions", headers=headers,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 101.0}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {str(10**9): 1.0}}, "logit_bias"),
    ({"prompt": "hi", "stream_options": {"include_usage": "maybe"}}, None),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[5, 6], "x"]}, "prompt"),
    ({"prompt": [10**7]}, None),
    ({}, "prompt"),
])
def test_invalid_completion_parameters_are_400(server, body, param):
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, **body})
    _assert_error(r, 400, param)
    _still_serving(server.base_url)


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, None),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools.0.function"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "messages"),
])
def test_invalid_chat_parameters_are_400(server, body, param):
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"model": MODEL, **body})
    _assert_error(r, 400, param)
    _still_serving(server.base_url)


def test_malformed_json_is_400_not_422(server):
    r = httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": ',
                   headers={"content-type": "application/json"})
    _assert_error(r, 400)
    _still_serving(server.base_url)


def test_unknown_model_is_404(server):
    r = httpx.post(server.base_url + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    err = _assert_error(r, 404, "model")
    assert err["code"] == "model_not_found"
    _still_serving(server.base_url)


def test_prompt_plus_max_tokens_over_max_model_len_is_400_naming_both(server):
    prompt = [5] * 40
    r = httpx.post(server.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 30})
    err = _assert_error(r, 400)
    assert "64" in err["message"] and "40" in err["message"] and "70" in err["message"]
    _still_serving(server.base_url)


def test_prompt_at_max_model_len_is_400(server):
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "word " * 80}]})
    err = _assert_error(r, 400)
    assert "64" in err["message"]


def test_openai_client_sees_bad_request_error(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", temperature=-2)
    assert info.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")


def test_body_over_limit_is_413(server):
    r = httpx.post(server.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": "x" * 10_000})
    err = _assert_error(r, 413)
    assert "4096" in err["message"]
    _still_serving(server.base_url)


def test_chunked_body_over_limit_is_413(server):
    def chunks():
        yield b'{"model": "fake-model", "prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'
    r = httpx.post(server.base_url + "/v1/completions", content=chunks(),
                   headers={"content-type": "application/json"})
    _assert_error(r, 413)
    _still_serving(server.base_url)


def test_unknown_route_is_404_in_openai_shape(server):
    _assert_error(httpx.get(server.base_url + "/v1/nothing"), 404)


def test_wrong_method_is_405_in_openai_shape(server):
    _assert_error(httpx.get(server.base_url + "/v1/completions"), 405)


def test_missing_or_wrong_api_key_is_401():
    with RunningServer(FakeEngine(), api_key="sekrit") as s:
        url = s.base_url + "/v1/completions"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        err = _assert_error(httpx.post(url, json=body), 401)
        assert err["code"] == "invalid_api_key"
        _assert_error(httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}), 401)
        _assert_error(httpx.get(s.base_url + "/v1/models"), 401)
        assert httpx.get(s.base_url + "/health").status_code == 200  # not under /v1
        _still_serving(s.base_url, headers={"Authorization": "Bearer sekrit"})
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="sekrit", max_retries=0)
        assert client.models.list().data[0].id == MODEL
        bad = openai.OpenAI(base_url=s.base_url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_full_waiting_queue_is_429_with_retry_after():
    # One running slot and one waiting slot: a long stream runs, a second one waits, a third
    # request finds the waiting queue full.
    engine = FakeEngine(max_queue_len=1, max_num_seqs=1, step_delay=0.01, max_model_len=512)
    with RunningServer(engine, retry_after=3) as s:
        url = s.base_url + "/v1/completions"

        def stream_body(max_tokens: int) -> dict:
            return {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": True}
        with httpx.Client(timeout=30) as c1, httpx.Client(timeout=30) as c2:
            with c1.stream("POST", url, json=stream_body(300)) as running:
                lines = running.iter_lines()
                assert next(lines).startswith("data: ")  # it runs
                with c2.stream("POST", url, json=stream_body(2)) as waiting:
                    assert waiting.status_code == 200
                    r = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
                    err = _assert_error(r, 429)
                    assert r.headers["retry-after"] == "3"
                    assert err["code"] == "queue_full"
                    running.close()  # the client leaves: its slot goes to the waiting one
                    assert "[DONE]" in "".join(waiting.iter_text())
        _still_serving(s.base_url)


def test_failed_request_is_500_for_it_alone():
    engine = FakeEngine()
    engine.fail_requests_with_prompt.add(7)
    with RunningServer(engine) as s:
        url = s.base_url + "/v1/completions"
        err = _assert_error(httpx.post(url, json={"model": MODEL, "prompt": [7, 8],
                                                  "max_tokens": 3}), 500)
        assert "injected request failure" in err["message"]
        with httpx.stream("POST", url, json={"model": MODEL, "prompt": [7, 8], "max_tokens": 3,
                                             "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
        _still_serving(s.base_url)


def test_health_is_503_while_the_engine_makes_no_progress():
    engine = FakeEngine()
    with RunningServer(engine, health_no_progress_timeout=0.2) as s:
        assert httpx.get(s.base_url + "/health").status_code == 200
        engine.stall.set()
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", s.base_url + "/v1/completions",
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                "stream": True}) as r:
                assert r.status_code == 200
                time.sleep(0.4)
                _assert_error(httpx.get(s.base_url + "/health"), 503)
                engine.stall.clear()
                assert "[DONE]" in "".join(r.iter_text())
        assert httpx.get(s.base_url + "/health").status_code == 200


def test_dead_engine_is_503_on_health_and_requests():
    engine = FakeEngine()
    engine.fail_next_steps = 1000
    with RunningServer(engine) as s:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        for _ in range(3):  # three failed steps in a row kill the loop
            r = httpx.post(s.base_url + "/v1/completions", json=body)
            assert r.status_code in (500, 503)
        deadline = time.monotonic() + 5
        while httpx.get(s.base_url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        _assert_error(httpx.get(s.base_url + "/health"), 503)
        _assert_error(httpx.post(s.base_url + "/v1/completions", json=body), 503)
