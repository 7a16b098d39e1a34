"""The FastAPI app of the OpenAI-compatible server, and running it under uvicorn."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

import peregrine
from peregrine.engine.async_engine import AsyncEngine, EngineDeadError
from peregrine.entrypoints.openai.errors import (GuardMiddleware, OpenAIError, bad_request,
                                                 error_response, install_error_handlers,
                                                 require_json_body)
from peregrine.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                   DetokenizeRequest, ErrorResponse,
                                                   MAX_REQUEST_ID_CHARS, ModelCard, ModelList,
                                                   TokenizeRequest)
from peregrine.entrypoints.openai.serving_chat import create_chat_completion, render_chat
from peregrine.entrypoints.openai.serving_common import (ServingContext, check_model,
                                                         prompt_char_limit)
from peregrine.entrypoints.openai.serving_completion import create_completion
from peregrine.entrypoints.openai.serving_tokenization import tokenizer_info
from peregrine.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from peregrine.entrypoints.openai.tool_parsers import get_tool_parser
from peregrine.entrypoints.openai.uvicorn_server import (FLUSH_GRACE_S, DrainingServer,
                                                         h11_with_read_timeout,
                                                         install_accept_error_filter,
                                                         raise_open_file_limit,
                                                         warn_if_backlog_capped)
from peregrine.metrics import ServerMetrics, StatLogger

logger = logging.getLogger(__name__)
# NOTE: a few threads: templates and tokenization are short once prompts are bounded, and the
# tokenizer releases the GIL; more threads would only compete with the engine thread.
_PREPROCESS_THREADS = 4
# NOTE: files the process needs besides client sockets (model files, pipes, logs, the listener).
_FD_RESERVE = 64
# NOTE: uvicorn's own default backlog; the socket listens as soon as it is bound (bind_socket).
_LISTEN_BACKLOG = 2048


def _errors(described: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for error statuses, each in OpenAI's error shape."""
    return {status: {"model": ErrorResponse, "description": text}
            for status, text in described.items()}


_MODEL_NOT_FOUND = "The model named in the request is not served here (`model_not_found`)."
_GENERATION_ERRORS = _errors({
    404: _MODEL_NOT_FOUND,
    429: "The waiting queue is full (`queue_full`; see Retry-After).",
    503: "The engine is dead or the server is shutting down."})
# NOTE: documented only: serving_common.response_id reads and checks it (a 400 naming it).
_REQUEST_ID_HEADER = {"parameters": [{
    "name": "X-Request-Id", "in": "header", "required": False,
    "description": "The response id's suffix (wins over the request_id field, as in vLLM).",
    "schema": {"type": "string", "minLength": 1, "maxLength": MAX_REQUEST_ID_CHARS}}]}


@dataclass(frozen=True)
class ServerArgs:
    """Server knobs (the engine's are EngineArgs); CLI flags are generated from these fields."""

    host: str = "127.0.0.1"  # this machine only; "0.0.0.0" (or "::") listens on every interface
    port: int = 8000
    api_key: str | None = None  # None: no auth; else required as "Authorization: Bearer" on /v1
    max_request_body_bytes: int = 8 * 1024 * 1024
    health_no_progress_timeout: float = 60.0  # seconds without progress (with work) -> 503
    log_stats_interval: float = 5.0  # seconds between stat log lines; 0 disables them
    retry_after: int = 1  # Retry-After seconds on 429
    uvicorn_log_level: str = "warning"
    # Chat templates sent in requests are Jinja programs with no time bound: refused unless trusted.
    trust_request_chat_template: bool = False
    # Longest text prompt, in characters (None: 16 per token of max_model_len, at least 16,384).
    max_prompt_chars: int | None = None
    # On SIGTERM/SIGINT: seconds open requests may still run before they are aborted.
    shutdown_timeout: float = 30.0
    # Open connections beyond this get 503 (uvicorn's limit_concurrency). None: the open-file
    # limit less a reserve, so the cap refuses cleanly before accept() fails with EMFILE.
    max_connections: int | None = None
    # NOTE: longer than clients keep idle connections (httpx and openai 5 s, aiohttp 15 s), so
    # the server never closes one just as its client reuses it (an error without retries).
    keep_alive_timeout: float = 20.0  # idle keep-alive connections close after this
    # A request's headers and body must arrive within this many seconds (slowloris).
    request_read_timeout: float = 30.0
    max_header_bytes: int = 16 * 1024  # h11's max incomplete event size: beyond it, 400
    # OpenAI's limits (temperature <= 2, at most 4 stop strings) unless relaxed to the engine's.
    relax_openai_limits: bool = False
    # Split <think>...</think> into reasoning_content: "qwen3" or "deepseek_r1" (None: off).
    reasoning_parser: str | None = None
    # Turn the model's tool-call text into tool_calls (tool_choice "auto"); the parser names the
    # model's format: "hermes" (Qwen2.5/Qwen3), "llama3_json", "mistral".
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (the model's "
                             "tool-call format)")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.keep_alive_timeout <= 0 or self.request_read_timeout <= 0:
            raise ValueError("keep_alive_timeout and request_read_timeout must be > 0 seconds")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")
        if self.health_no_progress_timeout <= 0:
            raise ValueError("health_no_progress_timeout must be > 0 seconds")
        if self.log_stats_interval < 0:
            raise ValueError("log_stats_interval must be >= 0 (0 disables the log line)")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")


def build_app(engine: AsyncEngine, args: ServerArgs | None = None) -> FastAPI:
    """The app around an AsyncEngine; the app's lifespan starts and stops the engine loop."""
    args = args or ServerArgs()
    engine.no_progress_timeout = args.health_no_progress_timeout
    mc = engine.config.model
    executor = ThreadPoolExecutor(_PREPROCESS_THREADS, thread_name_prefix="peregrine-preprocess")
    ctx = ServingContext(engine, mc.served_model_name, mc.max_model_len, args.retry_after,
                         max_prompt_chars=prompt_char_limit(mc.max_model_len, args.max_prompt_chars),
                         trust_request_chat_template=args.trust_request_chat_template,
                         relax_openai_limits=args.relax_openai_limits, executor=executor,
                         reasoning_parser=(get_reasoning_parser(args.reasoning_parser)
                                           if args.reasoning_parser else None),
                         tool_parser=(get_tool_parser(args.tool_call_parser)
                                      if args.tool_call_parser else None),
                         enable_auto_tool_choice=args.enable_auto_tool_choice)
    metrics = ServerMetrics(ctx.model_name, lambda: engine.stats)
    engine.observers.append(metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        task = None
        if args.log_stats_interval > 0:
            task = asyncio.create_task(StatLogger(lambda: engine.stats,
                                                  args.log_stats_interval).run())
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            await engine.shutdown()
            executor.shutdown(wait=False, cancel_futures=True)

    # NOTE: FastAPI's /docs and /redoc pages load their JavaScript and CSS from a CDN, so they
    # are blank on a machine without internet access; they are off, /openapi.json stays.
    app = FastAPI(title="Peregrine OpenAI-compatible server", version=peregrine.__version__,
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.state.draining = False  # set when shutdown starts: new generation requests get 503
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, max_body_bytes=args.max_request_body_bytes,
                       api_key=args.api_key)

    # NOTE: every route with a JSON body refuses other content types, and strings UTF-8 cannot
    # encode, before it runs.
    json_body: dict[str, Any] = {"dependencies": [Depends(require_json_body)]}

    @app.post("/v1/completions", responses=_GENERATION_ERRORS, openapi_extra=_REQUEST_ID_HEADER,
              **json_body)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await _unless_draining(raw.app, create_completion, ctx, body, raw)

    @app.post("/v1/chat/completions", responses=_GENERATION_ERRORS,
              openapi_extra=_REQUEST_ID_HEADER, **json_body)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await _unless_draining(raw.app, create_chat_completion, ctx, body, raw)

    def model_card() -> ModelCard:
        return ModelCard(id=ctx.model_name, root=mc.model, max_model_len=ctx.max_model_len)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[model_card()]).model_dump())

    # NOTE: `:path` because Hugging Face ids ("org/name") are served names too.
    @app.get("/v1/models/{model_id:path}", response_model=ModelCard,
             responses=_errors({404: "No model of that id is served here (`model_not_found`)."}))
    async def retrieve_model(model_id: str) -> JSONResponse:
        check_model(ctx, model_id)
        return JSONResponse(model_card().model_dump())

    @app.post("/tokenize", responses=_errors({404: _MODEL_NOT_FOUND}), **json_body)
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        check_model(ctx, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            if not body.messages:
                raise bad_request("messages must not be empty", "messages")
            ids = await render_chat(ctx, body.messages,
                                    add_generation_prompt=body.add_generation_prompt,
                                    chat_template=body.chat_template,
                                    template_kwargs=body.chat_template_kwargs)
        else:
            ids = await ctx.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len})

    @app.post("/detokenize", responses=_errors({404: _MODEL_NOT_FOUND}), **json_body)
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        check_model(ctx, body.model)
        tok = ctx.require_tokenizer("detokenize")
        try:
            text = await ctx.run(_decode_in_vocab, tok, body.tokens, mc.vocab_size)
        except ValueError as e:
            raise bad_request(str(e), "tokens") from e
        return JSONResponse({"prompt": text})

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> JSONResponse:
        """vLLM's /tokenizer_info: the tokenizer's configuration (lm-eval's remote tokenizer)."""
        return JSONResponse(tokenizer_info(ctx.require_tokenizer("/tokenizer_info")))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": peregrine.__version__})

    # NOTE: vLLM and SageMaker probe /ping (GET or POST); it answers as /health does.
    @app.get("/health")
    @app.get("/ping")
    @app.post("/ping")
    async def health() -> Response:
        if app.state.draining:
            return error_response(503, _SHUTTING_DOWN, code="server_shutting_down")
        try:
            engine.check_health()
        except EngineDeadError as e:
            return error_response(503, str(e), code="engine_unhealthy")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


_SHUTTING_DOWN = "server is shutting down"


async def _unless_draining(app: FastAPI, handler: Callable[..., Awaitable[Response]],
                           *args: Any) -> Response:
    """Run a generation handler, or answer 503 once shutdown has begun (a request the shutdown
    aborts gets its 503 from serving_common.stream_failure)."""
    if app.state.draining:
        raise OpenAIError(503, _SHUTTING_DOWN, code="server_shutting_down")
    return await handler(*args)


def _decode_in_vocab(tokenizer: Any, tokens: list[int], vocab_size: int) -> str:
    """The text of token ids; ValueError for one outside the vocabulary."""
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return tokenizer.decode(tokens)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (port 0: the OS picks a free one); OSError
    when the address is taken or cannot be used."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # NOTE: listen now, not when uvicorn starts: with SO_REUSEADDR, Linux lets a second
        # socket bind a port nobody listens on yet, so only listening makes the port ours.
        sock.listen(_LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_or_explain(host: str, port: int) -> socket.socket:
    """bind_socket, with a one-line ValueError saying why the address cannot be used."""
    try:
        return bind_socket(host, port)
    except OSError as e:
        why = "it is already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        raise ValueError(f"cannot listen on {host}:{port}: {why} (choose another --port or "
                         "--host)") from None


def make_uvicorn_server(app: FastAPI, args: ServerArgs) -> DrainingServer:
    """A uvicorn server for the app (call `.run(sockets=[...])` or `.serve()`); see
    DrainingServer for what happens on SIGTERM/SIGINT."""
    import uvicorn
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=False, http=h11_with_read_timeout(args.request_read_timeout),
                            timeout_keep_alive=args.keep_alive_timeout,
                            limit_concurrency=connection_cap(args.max_connections),
                            h11_max_incomplete_event_size=args.max_header_bytes,
                            # NOTE: a backstop only; DrainingServer aborts at shutdown_timeout.
                            timeout_graceful_shutdown=args.shutdown_timeout + FLUSH_GRACE_S)

    def on_drain() -> None:
        app.state.draining = True
        logger.info("shutting down: waiting up to %.0fs for open requests", args.shutdown_timeout)

    return DrainingServer(config, drain_timeout=args.shutdown_timeout, on_drain=on_drain,
                          abort=app.state.ctx.engine.shutdown)


def run_server(engine: AsyncEngine, args: ServerArgs, sock: socket.socket | None = None) -> None:
    """Serve until interrupted (blocking), on `sock` (from bind_socket) or on args.host:port."""
    raise_open_file_limit()  # NOTE: before make_uvicorn_server sizes the connection cap
    warn_if_backlog_capped(_LISTEN_BACKLOG)
    app = build_app(engine, args)
    server = make_uvicorn_server(app, args)
    if sock is None:
        sock = bind_socket(args.host, args.port)
    install_accept_error_filter()
    logger.info("serving %s on http://%s:%d", engine.config.model.served_model_name,
                args.host, sock.getsockname()[1])
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # NOTE: uvicorn re-raises SIGINT after its graceful shutdown
    logger.info("server stopped")


def connection_cap(max_connections: int | None) -> int | None:
    """The connection cap: the flag, else the open-file limit less _FD_RESERVE (None: no limit)."""
    if max_connections is not None:
        return max_connections
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    return max(16, soft - _FD_RESERVE)
