"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template (off the event
loop, in the server's thread pool, unless the conversation is short)."""
from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from peregrine.engine.async_engine import EngineRequest, RequestStream
from peregrine.entrypoints.chat_utils import (RESERVED_TEMPLATE_KWARGS, apply_chat_template,
                                              has_chat_template)
from peregrine.entrypoints.openai.chat_output import ChoiceOutput
from peregrine.entrypoints.openai.errors import bad_request, unsupported_value
from peregrine.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk,
                                                   ChatCompletionRequest, ChatCompletionResponse,
                                                   ChatLogprobs, ChatMessage, ChatResponseMessage,
                                                   ChatStreamChoice, ChatTokenLogprob, DeltaMessage,
                                                   NamedToolChoice, PromptTokensDetails,
                                                   TopLogprob, Usage, ChatTool)
from peregrine.entrypoints.openai.serving_common import (SSE_DONE, ServingContext, TokenText,
                                                         add_requests, build_sampling_params,
                                                         check_model, clamp_logprob,
                                                         output_error, check_request,
                                                         resolve_max_tokens, respond,
                                                         response_id, sse,
                                                         top_entries, truncate_prompt,
                                                         check_prompt_logprobs,
                                                         prompt_logprob_rows, requested_structure)
from peregrine.entrypoints.openai.tool_parsers import ToolParser
from peregrine.entrypoints.openai.tool_parsers.forced import (NamedToolParser, RequiredToolParser,
                                                              named_schema, required_schema)
from peregrine.structured_output.params import StructuredOutputsParams
from peregrine.outputs import CompletionOutput, PositionLogprobs

# NOTE: enough of the rendered prompt's end to see whether the template opened a <think> block.
_PROMPT_TAIL_TOKENS = 32


def request_template(ctx: ServingContext, chat_template: str | None,
                     template_kwargs: dict[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
    """The request's own chat template (refused unless trusted) and its template variables."""
    kwargs = dict(template_kwargs or {})
    in_kwargs = kwargs.pop("chat_template", None)
    for param, value in (("chat_template", chat_template),
                         ("chat_template_kwargs.chat_template", in_kwargs)):
        if value is None:
            continue
        if not ctx.trust_request_chat_template:
            # NOTE: a template is a program (Jinja); an untrusted one can loop for as long as it likes.
            raise bad_request(f"{param}: this server only renders its own chat template (start it "
                              "with --trust-request-chat-template to accept templates sent in "
                              "requests)", param)
        if not isinstance(value, str):
            raise bad_request(f"{param} must be a string", param)
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved[0]!r}",
                          "chat_template_kwargs")
    return (chat_template if chat_template is not None else in_kwargs), kwargs


async def render_chat(ctx: ServingContext, messages: list[ChatMessage], *,
                      add_generation_prompt: bool, continue_final_message: bool = False,
                      chat_template: str | None = None,
                      template_kwargs: dict[str, Any] | None = None,
                      tools: list[ChatTool] | None = None,
                      documents: list[dict[str, str]] | None = None,
                      add_special_tokens: bool = False) -> list[int]:
    """Apply the chat template and tokenize, both in the thread pool unless the conversation is
    short and the template the server's own (the template writes the special tokens itself;
    add_special_tokens adds the tokenizer's on top)."""
    tok = ctx.require_tokenizer("chat")
    template, kwargs = request_template(ctx, chat_template, template_kwargs)
    if template is None and not has_chat_template(tok):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    dumped = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for part in m.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"unsupported content part type {part.get('type')!r} "
                                      "(only text)", "messages")
        dumped.append(_template_message(m, i))
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    try:
        # NOTE: a template sent with the request (trusted by flag) always runs in the pool: its
        # cost does not follow from the size of the conversation.
        size = len(json.dumps([dumped, tool_dicts, documents, kwargs], default=str))
        render = ctx.run if template is not None else functools.partial(ctx.run_sized, size)
        text = await render(apply_chat_template, tok, dumped,
                             add_generation_prompt=add_generation_prompt,
                             continue_final_message=continue_final_message,
                             chat_template=template, template_kwargs=kwargs, tools=tool_dicts,
                             documents=documents)
    except ValueError as e:
        raise bad_request(str(e), "messages") from e
    except Exception as e:  # noqa: BLE001 - template errors (jinja raise_exception) are user errors
        raise bad_request(f"could not apply the chat template: {e}", "messages") from e
    return await ctx.encode(text, add_special_tokens=add_special_tokens, param="messages")


def _template_message(m: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates read it: an assistant's tool call arguments as a dict (OpenAI
    sends them as JSON text; templates write them out with tojson)."""
    dumped = m.model_dump(exclude={"tool_calls"})
    if m.tool_calls is None:
        return dumped
    calls = []
    for j, call in enumerate(m.tool_calls):
        param = f"messages.{index}.tool_calls.{j}.function.arguments"
        try:
            args = json.loads(call.function.arguments)
        except json.JSONDecodeError as e:
            raise bad_request(f"{param} must be a JSON object as text: {e}", param) from None
        if not isinstance(args, dict):
            raise bad_request(f"{param} must be a JSON object as text", param)
        calls.append({"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": args}})
    dumped["tool_calls"] = calls
    return dumped


def _tool_parser(ctx: ServingContext, req: ChatCompletionRequest
                 ) -> tuple[ToolParser | None, StructuredOutputsParams | None]:
    """The parser that turns this request's output into tool calls (None: content only), and
    the structure the text must have (a forced call's JSON, or response_format's); 400 for a
    tool_choice this server cannot honour."""
    choice = req.tool_choice
    structure = requested_structure(req)
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice is only valid together with tools", "tool_choice")
        return None, structure
    if choice == "none":
        return None, structure
    if choice == "auto" or choice is None:
        if not ctx.enable_auto_tool_choice or ctx.tool_parser is None:
            raise bad_request('tool_choice "auto" needs the server started with '
                              "--enable-auto-tool-choice and --tool-call-parser (or send "
                              'tool_choice "none")', "tool_choice")
        return ctx.tool_parser, structure
    # NOTE: a forced call is decoded under a JSON-schema grammar, so the model cannot do else.
    if structure is not None:
        raise bad_request("a forced tool_choice already fixes the output's structure; drop "
                          "response_format / structured_outputs", "tool_choice")
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
    if choice == "required":
        parallel = req.parallel_tool_calls is not False
        return RequiredToolParser(), StructuredOutputsParams(
            json=required_schema(functions, parallel))
    named = next((f for f in functions if f["name"] == choice.function.name), None)
    if named is None:
        raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not "
                          "among the tools", "tool_choice")
    return NamedToolParser(named["name"]), StructuredOutputsParams(json=named_schema(named))


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest,
                                 raw: Request) -> Response:
    """Handle one /v1/chat/completions call."""
    check_model(ctx, req.model)
    check_request(ctx, req)
    if req.modalities is not None and req.modalities != ["text"]:
        raise unsupported_value(f"modalities {req.modalities!r:.64} are not supported: this "
                                'server generates text only (only ["text"])', "modalities")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if not req.include_reasoning and ctx.reasoning_parser is not None:
        shown = "logprobs" if req.logprobs else "return_token_ids" if req.return_token_ids else None
        if shown is not None:
            raise bad_request(f"include_reasoning false hides the reasoning, but {shown} would "
                              "show its tokens; drop one of them", "include_reasoning")
    check_prompt_logprobs(req)
    request_id, engine_id = response_id(raw, req, "chatcmpl")
    tool_parser, structure = _tool_parser(ctx, req)
    ids = await render_chat(ctx, req.messages, add_generation_prompt=req.add_generation_prompt,
                            continue_final_message=req.continue_final_message,
                            chat_template=req.chat_template,
                            template_kwargs=req.chat_template_kwargs, tools=req.tools,
                            documents=req.documents, add_special_tokens=req.add_special_tokens)
    ids = truncate_prompt(ctx, ids, req.truncate_prompt_tokens, req.truncation_side)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(ctx, len(ids), requested, None, "messages")
    params = build_sampling_params(ctx, req, max_tokens=max_tokens,
                                   logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                   prompt_logprobs=req.prompt_logprobs, structure=structure)
    if tool_parser is not None and tool_parser.needs_special_tokens:
        params.skip_special_tokens = False  # NOTE: the call markers are special tokens
    stream = await add_requests(ctx, [EngineRequest(engine_id, ids, params, req.priority)])
    # NOTE: under a grammar the output has no room for a <think> block: no reasoning split.
    builder = _ChatBuilder(ctx, req, request_id, ids, tool_parser,
                           reasoning=structure is None)
    return await respond(raw, stream, builder, req.stream)


class _ChatBuilder:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, request_id: str,
                 prompt_ids: list[int], tool_parser: ToolParser | None = None,
                 reasoning: bool = True) -> None:
        self.ctx, self.req, self.request_id = ctx, req, request_id
        self.prompt_ids = prompt_ids
        self.num_prompt_tokens = len(prompt_ids)
        self.prompt_logprobs: list[PositionLogprobs | None] = []
        self.created = int(time.time())
        self.token_text = TokenText(ctx.tokenizer, req.return_tokens_as_token_ids)
        # NOTE: OpenAI ends a call forced by name with "stop"; auto and required calls end with
        # "tool_calls".
        self.calls_finish = "stop" if isinstance(req.tool_choice, NamedToolChoice) else "tool_calls"
        n = req.n
        self.text: list[list[str]] = [[] for _ in range(n)]
        self.num_tokens = [0] * n
        self.token_ids: list[list[int]] = [[] for _ in range(n)]  # for return_token_ids
        self.logprobs: list[list[ChatTokenLogprob]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.stop_reason: list[int | str | None] = [None] * n
        self.cached_tokens = 0
        tail = ""
        reasoning_parser = ctx.reasoning_parser if reasoning else None
        if reasoning_parser is not None and ctx.tokenizer is not None:
            tail = ctx.tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:])
        parallel = req.parallel_tool_calls is not False
        self.parsers = [ChoiceOutput(reasoning_parser, tool_parser, tail, parallel)
                        for _ in range(n)]

    def _logprob_rows(self, c: CompletionOutput) -> list[ChatTokenLogprob]:
        rows = []
        num = self.req.top_logprobs or 0
        positions: list[PositionLogprobs | None] = list(c.logprobs or [])
        for tid, pos in zip(c.token_ids, positions):
            chosen = pos.get(tid) if pos else None
            text = self.token_text.label(tid, chosen)
            tops = [TopLogprob(token=(t := self.token_text.label(i, lp)),
                               logprob=clamp_logprob(lp.logprob),
                               bytes=list(t.encode("utf-8")))
                    for i, lp in top_entries(pos or {}, num)]
            rows.append(ChatTokenLogprob(
                token=text, logprob=clamp_logprob(chosen.logprob) if chosen else -9999.0,
                bytes=list(text.encode("utf-8")), top_logprobs=tops))
        return rows

    def _absorb(self, c: CompletionOutput) -> tuple[bool, list[ChatTokenLogprob] | None]:
        """Record one completion's delta; return (moved, its new logprob rows)."""
        k = c.index
        if self.finish[k] is not None:
            return False, None
        rows = self._logprob_rows(c) if self.req.logprobs and c.logprobs is not None else None
        if rows:
            self.logprobs[k].extend(rows)
        self.text[k].append(c.text)
        self.num_tokens[k] += len(c.token_ids)
        if self.req.return_token_ids:
            self.token_ids[k].extend(c.token_ids)
        self.finish[k] = c.finish_reason
        self.stop_reason[k] = c.stop_reason
        return bool(c.text or c.token_ids or c.finish_reason is not None), rows

    def usage(self) -> Usage:
        completion = sum(self.num_tokens)
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                     total_tokens=self.num_prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens))

    async def collect(self, stream: RequestStream) -> ChatCompletionResponse:
        async for out in stream:
            err = output_error(out)
            if err is not None:
                raise err
            self.cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs:
                self.prompt_logprobs.extend(out.prompt_logprobs)
            for c in out.outputs:
                self._absorb(c)
        choices = []
        for k in range(self.req.n):
            reasoning, content, calls = self.parsers[k].whole("".join(self.text[k]))
            if not self.req.include_reasoning:
                reasoning = None
            finish = self.finish[k]
            if calls and finish == "stop":
                finish = self.calls_finish
            choices.append(ChatChoice(
                index=k, message=ChatResponseMessage(content=content, reasoning_content=reasoning,
                                                     tool_calls=calls),
                logprobs=ChatLogprobs(content=self.logprobs[k]) if self.req.logprobs else None,
                finish_reason=finish, stop_reason=self.stop_reason[k],
                token_ids=self.token_ids[k] if self.req.return_token_ids else None))
        plp = None
        if self.req.prompt_logprobs is not None:
            plp = prompt_logprob_rows(self.prompt_ids, self.prompt_logprobs,
                                      self.req.prompt_logprobs, self.token_text)
        return ChatCompletionResponse(
            id=self.request_id, model=self.ctx.model_name, choices=choices, usage=self.usage(),
            prompt_logprobs=plp,
            prompt_token_ids=self.prompt_ids if self.req.return_token_ids else None)

    def _chunk(self, choices: list[ChatStreamChoice], usage: Usage | None = None,
               prompt_token_ids: list[int] | None = None) -> str:
        """One SSE chunk as OpenAI sends it: a delta holds only the fields it sets, and `usage`
        is there only when stream_options.include_usage asked for it (vLLM's token ids only
        when return_token_ids asked for them)."""
        chunk = ChatCompletionChunk(id=self.request_id, created=self.created,
                                    model=self.ctx.model_name, choices=choices, usage=usage,
                                    prompt_token_ids=prompt_token_ids).model_dump(mode="json")
        if chunk["prompt_token_ids"] is None:
            del chunk["prompt_token_ids"]
        for choice in chunk["choices"]:
            if choice["token_ids"] is None:
                del choice["token_ids"]
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            for call in choice["delta"].get("tool_calls", ()):
                call["function"] = {k: v for k, v in call["function"].items() if v is not None}
                for key in ("id", "type"):
                    if call[key] is None:
                        del call[key]
        opts = self.req.stream_options
        if not (opts and opts.include_usage):
            del chunk["usage"]
        return sse(json.dumps(chunk, ensure_ascii=False))

    async def stream(self, stream: RequestStream) -> AsyncIterator[str]:
        opts = self.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        every_chunk = bool(opts and opts.usage_every_chunk)
        # NOTE: like OpenAI, the first chunk of every choice carries only the role.
        yield self._chunk([ChatStreamChoice(index=k, delta=DeltaMessage(role="assistant",
                                                                        content=""))
                           for k in range(self.req.n)], self.usage() if every_chunk else None,
                          self.prompt_ids if self.req.return_token_ids else None)
        async for out in stream:
            err = output_error(out)
            if err is not None:
                raise err
            self.cached_tokens = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                moved, rows = self._absorb(c)
                if not moved:
                    continue
                parser = self.parsers[c.index]
                reasoning, content, calls = parser.feed(c.text, c.finish_reason is not None)
                if not self.req.include_reasoning:
                    reasoning = ""
                finish = c.finish_reason
                if finish == "stop" and parser.called_tools:
                    finish = self.calls_finish
                token_ids = list(c.token_ids) if self.req.return_token_ids else None
                # NOTE: a chunk the parsers have no text for still carries its token ids.
                if not (reasoning or content or calls or rows or finish or token_ids):
                    continue
                delta = DeltaMessage(content=content or None, reasoning_content=reasoning or None,
                                     tool_calls=calls or None)
                choices.append(ChatStreamChoice(
                    index=c.index, delta=delta,
                    logprobs=ChatLogprobs(content=rows) if rows is not None else None,
                    finish_reason=finish, stop_reason=c.stop_reason, token_ids=token_ids))
            if choices:
                yield self._chunk(choices, self.usage() if every_chunk else None)
        if include_usage:
            yield self._chunk([], self.usage())
        yield SSE_DONE
