"""/openapi.json says what the server answers: 400 in OpenAI's error shape for invalid bodies,
text for /metrics, no body for /health."""
from __future__ import annotations

import httpx
import pytest

from fake_engine import FakeEngine
from server_utils import RunningServer
from test_errors import MODEL

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


@pytest.fixture(scope="module")
def server():
    with RunningServer(FakeEngine(max_model_len=64)) as s:
        yield s


@pytest.fixture(scope="module")
def schema(server) -> dict:
    r = httpx.get(server.base_url + "/openapi.json")
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize",
                                  "/detokenize"])
def test_validation_errors_are_documented_as_400_in_openai_shape(schema, path):
    responses = schema["paths"][path]["post"]["responses"]
    assert "422" not in responses
    assert responses["400"]["content"] == {"application/json": {"schema": _ERROR_REF}}


def test_error_model_in_the_schema_is_openais(schema):
    schemas = schema["components"]["schemas"]
    assert schemas["ErrorResponse"]["required"] == ["error"]
    assert set(schemas["ErrorInfo"]["properties"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in schemas


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}),
])
def test_an_invalid_body_gets_the_documented_status(server, schema, path, body):
    r = httpx.post(server.base_url + path, json=body)
    assert str(r.status_code) in schema["paths"][path]["post"]["responses"], r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_metrics_is_documented_as_text(server, schema):
    ok = schema["paths"]["/metrics"]["get"]["responses"]["200"]
    assert list(ok["content"]) == ["text/plain"]
    r = httpx.get(server.base_url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")


def test_health_is_documented_without_a_json_body(server, schema):
    responses = schema["paths"]["/health"]["get"]["responses"]
    assert "content" not in responses["200"]
    assert responses["503"]["content"] == {"application/json": {"schema": _ERROR_REF}}
    r = httpx.get(server.base_url + "/health")
    assert r.status_code == 200 and r.content == b""
