"""vLLM's extra routes: /ping (as /health), /v1/models/{id}; /docs off (it would load its assets
from a CDN), /openapi.json kept."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from fake_engine import FakeEngine
from server_utils import RunningServer
from test_errors import _assert_error


@pytest.fixture(scope="module")
def server():
    with RunningServer(FakeEngine(served_model_name="org/fake-model")) as s:
        yield s


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_200_without_a_body(server, method):
    r = httpx.request(method, server.base_url + "/ping")
    assert r.status_code == 200 and r.content == b""


def test_ping_is_503_when_the_engine_is_dead():
    engine = FakeEngine()
    engine.fail_next_steps = 1000
    with RunningServer(engine) as s:
        for _ in range(3):  # three failed steps in a row kill the loop
            httpx.post(s.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        deadline = time.monotonic() + 5
        while httpx.get(s.base_url + "/ping").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for method in ("GET", "POST"):
            err = _assert_error(httpx.request(method, s.base_url + "/ping"), 503)
            assert err["code"] == "engine_unhealthy"


def test_model_card_by_id_matches_the_list(server):
    listed = httpx.get(server.base_url + "/v1/models").json()["data"][0]
    r = httpx.get(server.base_url + "/v1/models/org/fake-model")
    assert r.status_code == 200, r.text
    card = r.json()
    assert card["id"] == "org/fake-model" and card["object"] == "model"
    assert {k: v for k, v in card.items() if k != "created"} == \
        {k: v for k, v in listed.items() if k != "created"}


def test_openai_client_retrieves_the_model(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve("org/fake-model").id == "org/fake-model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


@pytest.mark.parametrize("model_id", ["gpt-9", "org", "org/fake-model/x"])
def test_unknown_model_id_is_404_in_openai_shape(server, model_id):
    err = _assert_error(httpx.get(f"{server.base_url}/v1/models/{model_id}"), 404, "model")
    assert err["code"] == "model_not_found" and model_id in err["message"]


def test_model_card_needs_the_api_key():
    with RunningServer(FakeEngine(), api_key="secret") as s:
        assert httpx.get(s.base_url + "/v1/models/fake-model").status_code == 401
        r = httpx.get(s.base_url + "/v1/models/fake-model",
                      headers={"Authorization": "Bearer secret"})
        assert r.status_code == 200
        assert httpx.get(s.base_url + "/ping").status_code == 200  # probes need no key


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/docs/oauth2-redirect"])
def test_cdn_backed_doc_pages_are_off(server, path):
    _assert_error(httpx.get(server.base_url + path), 404)


def test_openapi_json_is_still_served(server):
    r = httpx.get(server.base_url + "/openapi.json")
    assert r.status_code == 200 and "/v1/completions" in r.json()["paths"]
