"""What completions and chat share: the context (thread pool, prompt limits), model check, length
check, sampling params, adding requests, logprob formatting, SSE framing, disconnect handling."""
from __future__ import annotations

import asyncio
import functools
import json
import math
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from peregrine.engine.async_engine import (AsyncEngine, EngineDeadError, EngineRequest,
                                           RequestAbortedError, RequestStream, ServerShuttingDownError)
from peregrine.engine.llm_engine import QueueFullError
from peregrine.entrypoints.openai.errors import (OpenAIError, bad_request, error_body,
                                                 unsupported_value)
from peregrine.entrypoints.openai.protocol import (MAX_REQUEST_ID_CHARS, OPENAI_MAX_STOP_STRINGS,
                                                   OPENAI_MAX_TEMPERATURE,
                                                   PromptLogprob, SamplingRequest, random_id)
from peregrine.entrypoints.openai.reasoning_parsers import ReasoningParser
from peregrine.entrypoints.openai.tool_parsers import ToolParser
from peregrine.outputs import Logprob, PositionLogprobs, RequestOutput
from peregrine.structured_output.params import StructuredOutputsParams
from peregrine.sampling_params import (MAX_STOP_STRINGS, MAX_TEMPERATURE, RequestOutputKind,
                                       SamplingParams)

T = TypeVar("T")
# NOTE: JSON has no -inf; a token with zero probability is reported with this logprob instead.
_MIN_LOGPROB = -9999.0
_GEN_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# NOTE: a token is rarely longer than a handful of characters, so a text over this many characters
# per token of max_model_len cannot fit the context in practice; the floor keeps small models usable.
PROMPT_CHARS_PER_TOKEN = 16
MIN_PROMPT_CHARS = 16 * 1024
# NOTE: work on at most this many characters (a few hundred tokens) runs on the event loop: it
# takes well under a millisecond, and handing it to the pool costs more than that under a burst
# (on the H200 with the demo model and 600 requests at once: 8.0 ms per call in the pool against
# 0.8 ms inline, 10% less throughput); larger inputs go to the pool.
INLINE_MAX_CHARS = 4096
# NOTE: ASCII digits only: int() also takes "٣", "1_000" and " 5 ", which no token id is spelled as.
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,12}")


def prompt_char_limit(max_model_len: int, override: int | None = None) -> int:
    """The most characters a text prompt may have before it is tokenized."""
    if override is not None:
        return override
    return max(PROMPT_CHARS_PER_TOKEN * max_model_len, MIN_PROMPT_CHARS)


@dataclass
class ServingContext:
    """Everything a handler needs; built once per server."""

    engine: AsyncEngine
    model_name: str
    max_model_len: int
    retry_after_s: int = 1
    max_prompt_chars: int = MIN_PROMPT_CHARS
    trust_request_chat_template: bool = False
    # False: OpenAI's limits (temperature <= 2, 4 stop strings); True: the engine's own bounds.
    relax_openai_limits: bool = False
    # Templates and tokenization of large inputs run here, never on the event loop (None: the
    # loop's default pool); inputs of at most inline_max_chars characters run inline.
    executor: Executor | None = None
    inline_max_chars: int = INLINE_MAX_CHARS
    reasoning_parser: ReasoningParser | None = None
    tool_parser: ToolParser | None = None
    enable_auto_tool_choice: bool = False

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise bad_request(f"{what} needs a tokenizer, but the server runs without one "
                              "(skip_tokenizer_init); send token ids instead")
        return self.tokenizer

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking work (a template, a tokenizer call) in the server's thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def run_sized(self, chars: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run work on `chars` characters of input inline when it is small (inline_max_chars),
        else in the thread pool."""
        if chars <= self.inline_max_chars:
            return fn(*args, **kwargs)
        return await self.run(fn, *args, **kwargs)

    def check_prompt_chars(self, text: str, param: str) -> None:
        """400 for a text too long to ever fit max_model_len, before any tokenizer sees it."""
        if len(text) > self.max_prompt_chars:
            raise bad_request(f"the prompt has {len(text)} characters, more than this server's "
                              f"limit of {self.max_prompt_chars} (--max-prompt-chars)", param)

    async def encode(self, text: str, *, add_special_tokens: bool = True,
                     param: str = "prompt") -> list[int]:
        """Token ids of a text prompt: length-checked, then tokenized (in the thread pool unless
        the text is short)."""
        self.check_prompt_chars(text, param)
        tok = self.require_tokenizer("a text prompt")
        # NOTE: encode without truncation or padding only reads the Rust tokenizer, so the pool's
        # threads may share one copy (changing those settings would need exclusive access).
        return await self.run_sized(len(text), tok.encode, text,
                                    add_special_tokens=add_special_tokens)


class ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


def check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise OpenAIError(404, f"The model `{model}` does not exist (this server serves "
                          f"`{ctx.model_name}`).", param="model", code="model_not_found")


_RELAX_FLAG = "--relax-openai-limits"


def check_request(ctx: ServingContext, req: SamplingRequest) -> None:
    """400 for fields accepted only at some values, and for OpenAI's limits (unless relaxed)."""
    if req.best_of is not None and req.best_of != req.n:
        raise unsupported_value("best_of is not supported (only best_of == n)", "best_of")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if req.allowed_token_ids is not None:
        vocab = ctx.engine.config.model.vocab_size
        bad = next((t for t in req.allowed_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"allowed_token_ids: token id {bad} is outside the vocabulary "
                              f"[0, {vocab})", "allowed_token_ids")
    if ctx.relax_openai_limits:
        return  # NOTE: SamplingParams holds the engine's bounds (MAX_TEMPERATURE, ...)
    if req.temperature is not None and req.temperature > OPENAI_MAX_TEMPERATURE:
        raise bad_request(f"temperature must be in [0, {OPENAI_MAX_TEMPERATURE:g}] (OpenAI's "
                          f"limit), got {req.temperature}; a server started with {_RELAX_FLAG} "
                          f"accepts up to {MAX_TEMPERATURE:g}", "temperature")
    num_stop = 1 if isinstance(req.stop, str) else len(req.stop or ())
    if num_stop > OPENAI_MAX_STOP_STRINGS:
        raise bad_request(f"stop may hold at most {OPENAI_MAX_STOP_STRINGS} strings (OpenAI's "
                          f"limit), got {num_stop}; a server started with {_RELAX_FLAG} accepts "
                          f"up to {MAX_STOP_STRINGS}", "stop")


def truncate_prompt(ctx: ServingContext, token_ids: list[int], keep: int | None,
                    side: str | None = None) -> list[int]:
    """`keep` tokens of a prompt (vLLM's truncate_prompt_tokens; -1 keeps as many as leave room
    for one generated token): the last ones, or the first with side "right"."""
    if keep is None:
        if side is not None:
            raise bad_request("truncation_side needs truncate_prompt_tokens", "truncation_side")
        return token_ids
    if keep == 0:
        raise bad_request("truncate_prompt_tokens must be >= 1, or -1 for the model's limit",
                          "truncate_prompt_tokens")
    if keep == -1:
        keep = ctx.max_model_len - 1
    return token_ids[:keep] if side == "right" else token_ids[-keep:]


# NOTE: a request id ends up in logs and the response id: no control characters.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def response_id(raw: Request, req: SamplingRequest, prefix: str) -> tuple[str, str]:
    """(the response's id, the engine's id for it). The id is `prefix-` and the X-Request-Id
    header, else the request_id field, else a random one (vLLM's order). The engine's id adds a
    random suffix to a client's id, so two requests sent with one id never collide."""
    header = raw.headers.get("x-request-id")
    given, param = (header, "X-Request-Id") if header is not None else (req.request_id,
                                                                         "request_id")
    if given is None:
        rid = random_id(prefix)
        return rid, rid
    if not 1 <= len(given) <= MAX_REQUEST_ID_CHARS or _CONTROL.search(given):
        raise bad_request(f"{param} must be 1 to {MAX_REQUEST_ID_CHARS} characters without "
                          "control characters", param)
    rid = f"{prefix}-{given}"
    return rid, f"{rid}-{uuid.uuid4().hex[:16]}"


def resolve_max_tokens(ctx: ServingContext, prompt_len: int, requested: int | None,
                       default: int | None, param: str) -> int:
    """The max_tokens to use; 400 when the prompt plus the request cannot fit max_model_len."""
    limit = ctx.max_model_len
    if prompt_len == 0:
        raise bad_request("the prompt is empty", param)
    if prompt_len >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens, but the prompt "
                          f"has {prompt_len} tokens, which leaves no room for the completion.",
                          param)
    if requested is None:
        # NOTE: an unset max_tokens is clamped to what fits rather than rejected.
        return min(default, limit - prompt_len) if default is not None else limit - prompt_len
    if prompt_len + requested > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you "
                          f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                          f"{requested} for the completion). Please reduce the prompt or "
                          "max_tokens.", "max_tokens")
    return requested


def _logit_bias(ctx: ServingContext, bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings -> bias in [-100, 100]) as token id -> bias."""
    if not bias:
        return None
    vocab = ctx.engine.config.model.vocab_size
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise bad_request(f"logit_bias keys must be token ids in ASCII digits, got {key[:32]!r}",
                              "logit_bias")
        tok = int(key)
        if not 0 <= tok < vocab:
            raise bad_request(f"logit_bias token id {tok} is outside the vocabulary [0, {vocab})",
                              "logit_bias")
        if not -100.0 <= value <= 100.0:  # NOTE: also refuses NaN
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
        out[tok] = float(value)
    return out


def _stop_token_ids(ctx: ServingContext, ids: list[int] | None) -> list[int] | None:
    """stop_token_ids, each checked to lie in the vocabulary."""
    vocab = ctx.engine.config.model.vocab_size
    bad = next((t for t in ids or () if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})",
                          "stop_token_ids")
    return ids


def requested_structure(req: SamplingRequest) -> StructuredOutputsParams | None:
    """What response_format or structured_outputs asks the text to match (None: free text)."""
    fmt = req.response_format
    if fmt is not None and fmt.type != "text" and req.structured_outputs is not None:
        raise bad_request("send response_format or structured_outputs, not both",
                          "structured_outputs")
    try:
        if req.structured_outputs is not None:
            so = req.structured_outputs
            return StructuredOutputsParams(json=so.json_, json_object=bool(so.json_object),
                                           regex=so.regex, choice=so.choice, grammar=so.grammar)
        if fmt is None or fmt.type == "text":
            if fmt is not None and fmt.json_schema is not None:
                raise bad_request("response_format.json_schema needs type json_schema",
                                  "response_format.json_schema")
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema",
                              "response_format.json_schema.schema")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        if fmt is not None and req.structured_outputs is None:
            param = "response_format.json_schema.schema"
        raise bad_request(str(e), param) from e


def build_sampling_params(ctx: ServingContext, req: SamplingRequest, *, max_tokens: int,
                          logprobs: int | None, prompt_logprobs: int | None = None,
                          structure: StructuredOutputsParams | None = None) -> SamplingParams:
    """SamplingParams from the request; generation_config.json fills what the user left unset
    (`structure`: what the text must match, see requested_structure)."""
    kwargs: dict[str, Any] = dict(
        n=req.n, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        stop=req.stop, stop_token_ids=_stop_token_ids(ctx, req.stop_token_ids), seed=req.seed,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        cache_salt=req.cache_salt, max_tokens=max_tokens, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, output_kind=RequestOutputKind.DELTA,
        logit_bias=_logit_bias(ctx, req.logit_bias), allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words, structured_outputs=structure)
    user_set = set()
    for name in _GEN_DEFAULT_FIELDS:
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
            user_set.add(name)
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from e
    gen_cfg = ctx.engine.config.model.generation_config
    return params.with_generation_defaults(gen_cfg, user_set)


async def add_requests(ctx: ServingContext, requests: list[EngineRequest]) -> RequestStream:
    """Add to the engine; map its refusals to 400 / 429 / 503."""
    try:
        return await ctx.engine.add_requests(requests)
    except QueueFullError as e:
        raise OpenAIError(429, f"the server is busy ({e}); retry later", code="queue_full",
                          headers={"Retry-After": str(ctx.retry_after_s)}) from e
    except ValueError as e:
        # NOTE: the engine's messages start with the field they are about, when there is one.
        word = str(e).split(" ", 1)[0]
        raise bad_request(str(e), word if word in SamplingRequest.model_fields else None) from e
    except EngineDeadError as e:
        raise OpenAIError(503, str(e), code="engine_dead") from e


def stream_failure(e: BaseException) -> OpenAIError:
    """The error to report for an exception raised while a stream was being read."""
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, str(e), code="engine_dead")
    if isinstance(e, ServerShuttingDownError):
        return OpenAIError(503, str(e), code="server_shutting_down")
    if isinstance(e, RequestAbortedError):
        return OpenAIError(500, str(e), code="aborted")
    return OpenAIError(500, f"internal error: {type(e).__name__}: {e}")


def output_error(out: RequestOutput) -> OpenAIError | None:
    """A request that failed inside the engine becomes a 500 (only that request)."""
    if out.error is None and not any(c.finish_reason == "error" for c in out.outputs):
        return None
    return OpenAIError(500, f"the request failed: {out.error or 'unknown error'}",
                       code="request_failed")


def sse(payload: Any) -> str:
    """One server-sent event carrying JSON."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


def sse_error(err: OpenAIError) -> str:
    return sse(error_body(err.status, err.message, err.param, err.code))


SSE_DONE = "data: [DONE]\n\n"


async def stream_guard(stream: RequestStream, body: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass SSE text through; on any exit (finish, error, client gone) abort what is left."""
    try:
        async for chunk in body:
            yield chunk
    except OpenAIError as e:
        yield sse_error(e)
        yield SSE_DONE
    except (EngineDeadError, RequestAbortedError) as e:
        yield sse_error(stream_failure(e))
        yield SSE_DONE
    finally:
        stream.abort()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, stream: RequestStream, work: Awaitable[T]) -> T:
    """Await `work` (reading `stream`); if the client leaves first, abort and raise."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise ClientDisconnected()
    except (EngineDeadError, RequestAbortedError) as e:
        raise stream_failure(e) from e
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        stream.abort()


async def respond(raw: Request, stream: RequestStream, builder: Any, streaming: bool):
    """An SSE response fed by builder.stream(), or the JSON of builder.collect() (499 if the
    client left first)."""
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    if streaming:
        return StreamingResponse(stream_guard(stream, builder.stream(stream)),
                                 media_type="text/event-stream")
    try:
        response = await unless_disconnected(raw, stream, builder.collect(stream))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(response.model_dump())


# ----------------------------------------------------------------------------- logprobs
def clamp_logprob(lp: float) -> float:
    return lp if math.isfinite(lp) else _MIN_LOGPROB


class TokenText:
    """Token id -> its text, from the engine's decoded_token or the tokenizer (cached); `label`
    is how logprobs name the token ("token_id:N" with return_tokens_as_token_ids)."""

    def __init__(self, tokenizer: Any, as_token_ids: bool = False) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}
        self.as_token_ids = as_token_ids

    def label(self, token_id: int, lp: Logprob | None = None) -> str:
        """The token as logprobs name it: its text, or "token_id:N"."""
        return f"token_id:{token_id}" if self.as_token_ids else self(token_id, lp)

    def __call__(self, token_id: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id]) if self._tok is not None else f"token_id:{token_id}"
            self._cache[token_id] = text
        return text


def check_prompt_logprobs(req: SamplingRequest) -> None:
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs is only supported without streaming", "prompt_logprobs")


def prompt_logprob_rows(token_ids: list[int], rows: list[PositionLogprobs | None], num: int,
                        token_text: TokenText) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or the token's own logprob
    and the top-`num` at that position, keyed by token id."""
    rows = (list(rows) + [None] * len(token_ids))[:len(token_ids)]
    out: list[dict[str, PromptLogprob] | None] = []
    for tid, pos in zip(token_ids, rows):
        if pos is None:
            out.append(None)
            continue
        keep = dict(top_entries(pos, num))
        if tid in pos:
            keep[tid] = pos[tid]
        out.append({str(t): PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank,
                                          decoded_token=token_text(t, lp))
                    for t, lp in keep.items()})
    return out


def top_entries(pos: PositionLogprobs, num: int) -> list[tuple[int, Logprob]]:
    """The top-`num` entries of one position, by rank."""
    ranked = [(tid, lp) for tid, lp in pos.items() if lp.rank is not None and lp.rank <= num]
    ranked.sort(key=lambda kv: kv[1].rank)
    return ranked[:num]
