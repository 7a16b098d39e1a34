"""/openapi.json says what the server answers: 400 in OpenAI's error shape for invalid bodies,
404/429/503 where they happen, unknown fields refused, server-sent events for streams, text for
/metrics, no body for /health and /ping, the model card route."""
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


@pytest.mark.parametrize("path,status", [
    ("/v1/completions", "404"), ("/v1/completions", "429"), ("/v1/completions", "503"),
    ("/v1/chat/completions", "404"), ("/v1/chat/completions", "429"),
    ("/v1/chat/completions", "503"), ("/tokenize", "404"), ("/detokenize", "404"),
])
def test_generation_and_tokenizer_errors_are_documented(schema, path, status):
    assert schema["paths"][path]["post"]["responses"][status]["content"] == \
        {"application/json": {"schema": _ERROR_REF}}


def test_unknown_request_fields_are_documented_as_refused(server, schema):
    schemas = schema["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "StreamOptions",
                 "TokenizeRequest", "DetokenizeRequest"):
        assert schemas[name]["additionalProperties"] is False, name
    r = httpx.post(server.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": "hi", "guided_json": {}})
    assert str(r.status_code) in schema["paths"]["/v1/completions"]["post"]["responses"]


def test_model_card_route_is_documented_with_its_404(server, schema):
    op = schema["paths"]["/v1/models/{model_id}"]["get"]
    assert op["responses"]["200"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/ModelCard"}
    assert op["responses"]["404"]["content"] == {"application/json": {"schema": _ERROR_REF}}
    assert "400" not in op["responses"] and "422" not in op["responses"]
    r = httpx.get(server.base_url + "/v1/models/nope")
    assert str(r.status_code) in op["responses"]


@pytest.mark.parametrize("method", ["get", "post"])
def test_ping_is_documented_like_health(server, schema, method):
    responses = schema["paths"]["/ping"][method]["responses"]
    assert "content" not in responses["200"]
    assert responses["503"]["content"] == {"application/json": {"schema": _ERROR_REF}}
    r = httpx.request(method.upper(), server.base_url + "/ping")
    assert r.status_code == 200 and r.content == b""


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2, "stream": True}),
])
def test_streamed_answers_are_documented_as_server_sent_events(server, schema, path, body):
    ok = schema["paths"][path]["post"]["responses"]["200"]
    assert set(ok["content"]) == {"application/json", "text/event-stream"}
    r = httpx.post(server.base_url + path, json=body)
    assert r.status_code == 200 and r.headers["content-type"].split(";")[0] in ok["content"]
    assert r.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_generation_routes_document_the_request_id_header_and_extras(schema, path):
    op = schema["paths"][path]["post"]
    [header] = [p for p in op["parameters"] if p["in"] == "header"]
    assert header["name"] == "X-Request-Id" and header["required"] is False
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
    fields = set(schema["components"]["schemas"][ref]["properties"])
    assert {"request_id", "cache_salt", "return_tokens_as_token_ids", "return_token_ids",
            "spaces_between_special_tokens", "truncation_side"} <= fields
    assert ("documents" in fields) == (path == "/v1/chat/completions")
