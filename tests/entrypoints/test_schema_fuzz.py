"""Requests generated from the served /openapi.json, for every route: bodies that follow the
documented request schema and bodies that break it (a required field dropped, a field of the
wrong type, an unknown field, not an object). Every answer must be documented: no 5xx, a status
the route lists, a content type listed for that status, errors in OpenAI's shape, and JSON
bodies that validate against the documented response schema. test_fuzz.py throws hand-picked
values at the generation routes of the real model; this one follows the schema on every route."""
from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_engine import FakeEngine
from server_utils import RunningServer

jsonschema = pytest.importorskip("jsonschema")

_MODEL = "fake-model"
_MAX_DEPTH = 4
_JSON_SCALARS = (st.none() | st.booleans() | st.integers(-(2 ** 40), 2 ** 40)
                 | st.floats(allow_nan=False, allow_infinity=False, width=32) | st.text(max_size=8))
_ANY_JSON = st.recursive(_JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                         | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=5)


@pytest.fixture(scope="module")
def server():
    with RunningServer(FakeEngine(max_model_len=64, max_num_seqs=64)) as s:
        yield s


@pytest.fixture(scope="module")
def openapi(server) -> dict[str, Any]:
    r = httpx.get(server.base_url + "/openapi.json")
    assert r.status_code == 200, r.text
    return r.json()


def _resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        node: Any = doc
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def from_schema(doc: dict[str, Any], schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy:
    """Values that follow a (pydantic-generated) JSON schema: the keywords /openapi.json uses."""
    schema = _resolve(doc, schema)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(doc, s, depth + 1) for s in schema[key]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema(doc, {**schema, "type": k}, depth) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind in ("integer", "number"):
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if "exclusiveMinimum" in schema:
            lo = schema["exclusiveMinimum"] + (1 if kind == "integer" else 1e-6)
        if "exclusiveMaximum" in schema:
            hi = schema["exclusiveMaximum"] - (1 if kind == "integer" else 1e-6)
        # NOTE: a small range near the low end keeps token counts and n within what a quick
        # run can answer; the edges themselves stay reachable.
        lo = -100 if lo is None else lo
        hi = lo + 100 if hi is None else hi
        if kind == "integer":
            return st.integers(int(lo), int(hi))
        return st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0),
                       max_size=min(schema.get("maxLength", 12), 12))
    if kind == "array":
        if depth >= _MAX_DEPTH:
            return st.just([]) if schema.get("minItems", 0) == 0 else st.nothing()
        items = from_schema(doc, schema.get("items", {}), depth + 1)
        return st.lists(items, min_size=schema.get("minItems", 0),
                        max_size=max(schema.get("minItems", 0), min(schema.get("maxItems", 3), 3)))
    if kind == "object" or "properties" in schema:
        return _object(doc, schema, depth)
    return _ANY_JSON  # {}: anything


def _object(doc: dict[str, Any], schema: dict[str, Any], depth: int) -> st.SearchStrategy:
    props = schema.get("properties", {})
    required = [k for k in schema.get("required", []) if k in props]
    optional = [k for k in props if k not in required]
    if depth >= _MAX_DEPTH:
        optional = []

    @st.composite
    def build(draw) -> dict[str, Any]:
        out = {k: draw(from_schema(doc, props[k], depth + 1)) for k in required}
        most = draw(st.sampled_from([1, 4]))
        for k in draw(st.lists(st.sampled_from(optional), unique=True, max_size=most)) \
                if optional else []:
            out[k] = draw(from_schema(doc, props[k], depth + 1))
        if schema.get("additionalProperties") not in (None, False) and draw(st.booleans()):
            out[draw(st.text(min_size=1, max_size=6))] = draw(_JSON_SCALARS)
        return out

    return build()


def _wrong_type(value: Any) -> st.SearchStrategy:
    """A JSON value of another type than `value`'s."""
    others = {bool: st.integers() | st.text(max_size=4), int: st.text(max_size=4) | st.lists(
        st.integers(), max_size=2), float: st.text(max_size=4) | st.booleans(),
        str: st.integers() | st.lists(st.booleans(), max_size=2) | st.dictionaries(
            st.text(max_size=3), st.integers(), max_size=2),
        list: st.text(max_size=4) | st.integers(), dict: st.text(max_size=4) | st.integers(),
        type(None): st.lists(st.integers(), max_size=2) | st.dictionaries(
            st.text(max_size=3), st.integers(), max_size=2)}
    return others[type(value)]


@st.composite
def _request(draw, doc: dict[str, Any], path: str, method: str) -> tuple[str, str, bytes | None]:
    """(url path, kind, body): a documented or a broken request for one route."""
    op = doc["paths"][path][method]
    url = path
    for p in op.get("parameters", []):
        if p["in"] == "path":
            value = draw(st.just(_MODEL) | st.text(min_size=1, max_size=12))
            url = url.replace("{" + p["name"] + "}", quote(value, safe=""))
    content = op.get("requestBody", {}).get("content", {}).get("application/json")
    if content is None:
        return url, "no body", None
    schema = _resolve(doc, content["schema"])
    body = draw(from_schema(doc, content["schema"]))
    if isinstance(body, dict) and "model" in body and draw(st.integers(0, 3)):
        body["model"] = _MODEL  # NOTE: mostly the served name, so requests get past the check
    if "stream" in schema.get("properties", {}) and draw(st.integers(0, 3)) == 0:
        body["stream"] = True  # NOTE: a streamed answer has its own content type to document
    kind = draw(st.sampled_from(["valid", "valid", "drop required", "wrong type", "unknown field",
                                 "not an object"]))
    required = [k for k in schema.get("required", []) if k in body]
    if kind == "drop required" and required:
        del body[draw(st.sampled_from(required))]
    elif kind == "wrong type" and body:
        key = draw(st.sampled_from(sorted(body)))
        body[key] = draw(_wrong_type(body[key]))
    elif kind == "unknown field":
        body[draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in schema.get(
            "properties", {})))] = draw(_JSON_SCALARS)
    elif kind == "not an object":
        body = draw(st.lists(st.integers(), max_size=2) | st.text(max_size=4) | st.integers())
    return url, kind, json.dumps(body).encode()


def _validator(doc: dict[str, Any], schema: dict[str, Any]) -> Any:
    # NOTE: the schema's $refs point into the document; validating against a copy of the
    # schema that carries the document's components resolves them.
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def check_answer(doc: dict[str, Any], path: str, method: str, r: httpx.Response, sent: Any) -> None:
    """The answer is one the schema documents for this route."""
    where = f"{method.upper()} {path} -> {r.status_code} for {sent!r}: {r.text[:300]}"
    assert r.status_code < 500, where
    responses = doc["paths"][path][method]["responses"]
    assert str(r.status_code) in responses, "undocumented status: " + where
    documented = responses[str(r.status_code)].get("content", {})
    media = r.headers.get("content-type", "").split(";")[0].strip()
    if not documented:
        assert r.content == b"", "a body where none is documented: " + where
        return
    assert media in documented, f"undocumented content type {media!r}: " + where
    if r.status_code >= 400:
        err = r.json().get("error")
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} \
            and err["message"], "not OpenAI's error shape: " + where
    if media == "application/json":
        errors = sorted(_validator(doc, documented[media].get("schema", {})).iter_errors(
            r.json()), key=str)
        assert not errors, f"{errors[0].message} at {list(errors[0].path)}: " + where
    elif media == "text/event-stream":
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", where
        for e in events[:-1]:
            json.loads(e)


def _routes(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p, m) for p, ops in doc["paths"].items() for m in ops]


# NOTE: fixed (derandomized) examples, about 40 a route; PEREGRINE_FUZZ_RANDOM=1 searches anew.
_EXAMPLES = int(os.environ.get("PEREGRINE_SCHEMA_FUZZ_EXAMPLES", "40"))


@pytest.mark.slow
def test_every_route_answers_as_documented(server, openapi) -> None:
    routes = _routes(openapi)
    assert len(routes) >= 10, routes  # the schema lists the server's routes
    client = httpx.Client(base_url=server.base_url, timeout=30)

    @settings(max_examples=_EXAMPLES * len(routes), deadline=None,
              derandomize=not os.environ.get("PEREGRINE_FUZZ_RANDOM"),
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def one(data) -> None:
        path, method = data.draw(st.sampled_from(routes))
        url, kind, body = data.draw(_request(openapi, path, method))
        headers = {"Content-Type": "application/json"} if body is not None else {}
        r = client.request(method.upper(), url, content=body, headers=headers)
        seen.setdefault((path, method), set()).add(r.status_code)
        check_answer(openapi, path, method, r, (kind, body))

    seen: dict[tuple[str, str], set[int]] = {}
    try:
        one()
    finally:
        client.close()
    # NOTE: the run reached both sides of every generation route: answers and refusals.
    for route in (("/v1/completions", "post"), ("/v1/chat/completions", "post"),
                  ("/tokenize", "post"), ("/detokenize", "post")):
        assert 200 in seen.get(route, set()) and 400 in seen.get(route, set()), (route, seen)


def test_schema_generation_follows_the_request_schemas(openapi) -> None:
    # The generator's "valid" bodies validate against the schema they come from.
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest",
                 "DetokenizeRequest"):
        ref = {"$ref": f"#/components/schemas/{name}"}
        validator = _validator(openapi, ref)

        @settings(max_examples=25, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(body=from_schema(openapi, ref))
        def follows(body) -> None:
            assert not list(validator.iter_errors(body)), (name, body)

        follows()


def test_an_undocumented_answer_is_caught(openapi) -> None:
    # The checker fails what it must: a 5xx, an undocumented status, an error not in OpenAI's
    # shape, a JSON body the schema rejects.
    req = httpx.Request("GET", "http://x/v1/models/m")
    cases = [httpx.Response(500, json={"error": {}}, request=req),
             httpx.Response(418, json={}, request=req),
             httpx.Response(404, json={"detail": "nope"}, request=req),
             httpx.Response(200, json={"id": 5}, request=req)]
    for resp in cases:
        with pytest.raises(AssertionError):
            check_answer(openapi, "/v1/models/{model_id}", "get", resp, None)
    ok = httpx.Response(404, json={"error": {"message": "m", "type": "t", "param": None,
                                             "code": None}}, request=req)
    check_answer(openapi, "/v1/models/{model_id}", "get", ok, None)
