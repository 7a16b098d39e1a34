"""Errors in OpenAI's shape {"error": {message, type, param, code}}, their FastAPI handlers (and
how /openapi.json describes them), the ASGI guard (request body limit, API key) that runs before
any route, and the JSON body check (content type, UTF-8)."""
from __future__ import annotations

import hmac
import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from peregrine.entrypoints.openai.protocol import UNSUPPORTED_FIELDS, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_exceeded",
          500: "server_error", 503: "service_unavailable"}


_MAX_NAME_CHARS = 100  # of an unknown field's name, when an error message repeats it
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "is-instance"}
# Paths that need the API key (when the server has one): the API and the tokenizer endpoints.
_AUTH_PATHS = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")
# NOTE: a lone surrogate reaches a parsed JSON string as a \uD800-\uDFFF escape, or as raw bytes
# that are not strict UTF-8 (Python's json decodes bytes with "surrogatepass").
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
# Routes whose 200 is a JSON body, or server-sent events when the request says `stream: true`.
_STREAMING_ROUTES = ("/v1/completions", "/v1/chat/completions")
# Routes whose 200 is not JSON: path -> (media type or None for no body, description).
_PLAIN_ROUTES: dict[str, tuple[str | None, str]] = {
    "/health": (None, "The engine is healthy (empty body)."),
    "/ping": (None, "The engine is healthy (empty body; vLLM's and SageMaker's name for /health)."),
    "/metrics": ("text/plain", "Prometheus metrics in the text exposition format."),
}


class OpenAIError(Exception):
    """An error answered as {"error": {...}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The JSON body of an error answer."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def unsupported_value(message: str, param: str) -> OpenAIError:
    """400 for a known field at a value this server does not implement."""
    return OpenAIError(400, message, param=param, code="unsupported_value")


def _error_param(error: Any) -> str | None:
    loc = [str(p) for p in error.get("loc", ()) if p != "body"]
    # NOTE: union members show up in loc as type names ("str", "list[int]"); keep field names.
    loc = [p for p in loc if p not in _TYPE_TAGS and not any(c in p for c in "[]-")]
    return ".".join(loc) or None


def _unknown_field_message(param: str) -> str:
    """The message for a field the request model does not declare (OpenAI's wording for unknown
    ones; the reason for the ones OpenAI or vLLM define that this server does not implement)."""
    reason = UNSUPPORTED_FIELDS.get(param)
    if reason is None:
        return f"Unrecognized request argument supplied: {param}"
    return f"{param} is not supported: {reason}"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """(message, param, code) of the first problem, unknown fields first: they are the cause."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None, "invalid_value"
    # NOTE: an unknown key is named as sent (any characters, even none), only shortened.
    unknown = [".".join(str(p) for p in e.get("loc", ()) if p != "body")[:_MAX_NAME_CHARS]
               for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        order = {name: i for i, name in enumerate(UNSUPPORTED_FIELDS)}
        param = min(unknown, key=lambda p: order.get(p, len(order)))
        return _unknown_field_message(param), param, "unsupported_parameter"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg')}", None, "invalid_value"
    param = _error_param(first)
    where = f"{param}: " if param else ""
    extra = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{where}{first.get('msg', 'invalid value')}{extra}", param, "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    """Map every error (ours, validation, routing, unexpected) to the OpenAI shape, and make
    /openapi.json say so."""
    document_errors(app)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _validation_message(exc)
        return error_response(400, message, param, code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(500, f"internal server error: {type(exc).__name__}")


def document_errors(app: FastAPI) -> None:
    """Fix the generated OpenAPI schema once, when first served: 400 in OpenAI's error shape
    where FastAPI documents its 422, and no JSON claim for /health and /metrics."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _patch_schema(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _patch_schema(schema: dict[str, Any]) -> None:
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error_schema.pop("$defs", {}))
    schemas["ErrorResponse"] = error_schema
    error_json = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            # NOTE: only a body can fail validation here (path parameters are plain strings).
            if responses.pop("422", None) is not None and "requestBody" in op:
                responses["400"] = {"description": "Invalid request (OpenAI's error shape; "
                                    "`param` names the field).", "content": error_json}
            if path in _STREAMING_ROUTES and "200" in responses:
                responses["200"].setdefault("content", {})["text/event-stream"] = {
                    "schema": {"type": "string"}}
                responses["200"]["description"] = (
                    "The answer; with `stream: true`, server-sent events (`data: {chunk}` lines, "
                    "then `data: [DONE]`).")
            if path in _PLAIN_ROUTES:
                media_type, description = _PLAIN_ROUTES[path]
                ok: dict[str, Any] = {"description": description}
                if media_type is not None:
                    ok["content"] = {media_type: {"schema": {"type": "string"}}}
                responses["200"] = ok
        if path in ("/health", "/ping"):
            for op in ops.values():
                op["responses"]["503"] = {"description": "The engine is dead or stuck.",
                                          "content": error_json}
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)


class GuardMiddleware:
    """Rejects oversized bodies (413) and, with an API key, unauthenticated calls to /v1/*,
    /tokenize, /detokenize and /tokenizer_info (401).

    The body is read up front (bounded by `max_body_bytes`) and replayed to the app; after that
    `receive` passes through, so the app still sees the client's disconnect.
    """

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, api_key: str | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and _needs_key(scope["path"]) and not self._authorized(scope):
            await _send_error(send, 401, "invalid or missing API key (send 'Authorization: Bearer "
                              "<key>')", "invalid_api_key")
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _send_error(send, 413, f"request body of {int(length)} bytes exceeds the limit "
                              f"of {self.max_body_bytes} bytes", "request_too_large")
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await _send_error(send, 413, f"request body exceeds the limit of "
                                  f"{self.max_body_bytes} bytes", "request_too_large")
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, scope: Scope) -> bool:
        assert self.api_key is not None
        for name, value in scope.get("headers") or []:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(token.strip().encode(), self.api_key.encode())
        return False


def _needs_key(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in _AUTH_PATHS)


def first_non_utf8(value: Any) -> tuple[str, ...] | None:
    """Path to the first string in parsed JSON that UTF-8 cannot encode (a lone surrogate), or None."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                return path
        elif isinstance(v, dict):
            if not all(_encodable(k) for k in v):
                return path
            stack.extend(reversed([(path + (k,), item) for k, item in v.items()
                                   if isinstance(item, (str, dict, list))]))
        elif isinstance(v, list):
            stack.extend(reversed([(path + (str(i),), item) for i, item in enumerate(v)
                                   if isinstance(item, (str, dict, list))]))
    return None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_json_media_type(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


async def require_json_body(request: Request) -> None:
    """Route dependency: 400 unless the body is sent as JSON (Content-Type: application/json),
    and 400 naming the field for a string in it that is not valid UTF-8."""
    # NOTE: without the header FastAPI would leave the body unparsed and answer a puzzling "Input
    # should be a valid dictionary"; it keeps the check because a browser may send a
    # header-less POST cross-site without a CORS preflight, so the server keeps refusing it.
    if not _is_json_media_type(request.headers.get("content-type")):
        raise OpenAIError(400, "the request body must be JSON, sent with the header "
                          "'Content-Type: application/json' (got "
                          f"{_shown_content_type(request.headers.get('content-type'))})",
                          code="invalid_content_type")
    body = await request.body()
    if not _SURROGATE_ESCAPE.search(body) and (body.isascii() or _is_utf8(body)):
        return
    try:
        data = json.loads(body)
    except ValueError:
        return  # NOTE: FastAPI answers malformed JSON itself
    path = first_non_utf8(data)
    if path is not None:
        param = ".".join(path) or None
        raise bad_request(f"{param or 'the request body'} is not valid UTF-8 (it holds a lone "
                          "UTF-16 surrogate)", param)


def _shown_content_type(value: str | None) -> str:
    if value is None:
        return "no Content-Type header"
    return f"Content-Type {value[:64]!r}"


async def _send_error(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
