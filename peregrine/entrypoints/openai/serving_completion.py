"""POST /v1/completions: prompts as text, token ids or lists of either; streaming or not."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from peregrine.engine.async_engine import EngineRequest, RequestStream
from peregrine.entrypoints.openai.errors import bad_request
from peregrine.entrypoints.openai.protocol import (CompletionChoice, CompletionChunk,
                                                   CompletionLogprobs, CompletionRequest,
                                                   CompletionResponse, PromptTokensDetails, Usage)
from peregrine.entrypoints.openai.serving_common import (SSE_DONE, ServingContext, TokenText,
                                                         add_requests, build_sampling_params,
                                                         check_model, clamp_logprob,
                                                         output_error, check_request,
                                                         resolve_max_tokens, respond,
                                                         response_id, sse,
                                                         top_entries, truncate_prompt,
                                                         check_prompt_logprobs,
                                                         prompt_logprob_rows, requested_structure)
from peregrine.engine.detokenizer import IncrementalDetokenizer
from peregrine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from peregrine.sampling_params import SamplingParams

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]
    # echo: where each token starts in `text` (tokens the text does not show, like a BOS the
    # tokenizer added, start where the next visible one does)
    offsets: list[int] | None = None


def _encode_with_offsets(tokenizer: Any, text: str, add_special_tokens: bool = True
                         ) -> tuple[list[int], list[int] | None]:
    """Token ids of `text` (with the tokenizer's special tokens unless add_special_tokens is
    false) and each token's start in it, from the fast tokenizer's offset mapping (None when the
    tokenizer has none)."""
    try:
        enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        return tokenizer.encode(text, add_special_tokens=add_special_tokens), None
    offsets, end = [], 0
    for start, stop in enc["offset_mapping"]:
        # NOTE: an added special token has the empty span (0, 0); it sits where the text goes on.
        offsets.append(start if stop > start else end)
        end = max(end, stop)
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        return list(enc["input_ids"]), None
    return list(enc["input_ids"]), offsets


def _render_with_offsets(tokenizer: Any, token_ids: list[int]) -> tuple[str, list[int]]:
    """The text of token ids (special tokens kept) built token by token, and where each token's
    text starts in it (a token that ends inside a UTF-8 character adds no text of its own)."""
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    offsets = []
    for tid in token_ids:
        offsets.append(len(detok.output_text))
        detok.update([tid])
    return detok.output_text, offsets


async def _echo_text(ctx: ServingContext, prompt: _Prompt) -> _Prompt:
    """Fill the echoed text and its token offsets: a text prompt echoes its own text, token ids
    echo their rendering."""
    if prompt.offsets is not None or ctx.tokenizer is None:
        return prompt
    text, offsets = await ctx.run(_render_with_offsets, ctx.tokenizer, prompt.token_ids)
    return _Prompt(text, prompt.token_ids, offsets)


@dataclass
class _Choice:
    """One choice being assembled: prompt index i, completion j -> OpenAI index i * n + j."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: CompletionLogprobs | None = None
    text_len: int = 0  # characters emitted so far (for text_offset)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False  # streaming: the echoed prompt was sent
    token_ids: list[int] = field(default_factory=list)  # generated ones, for return_token_ids
    prompt_ids_sent: bool = False  # streaming: the prompt's token ids were sent


async def _parse_prompts(ctx: ServingContext, req: CompletionRequest) -> list[_Prompt]:
    p = req.prompt
    if isinstance(p, str):
        items: list[str | list[int]] = [p]
    elif not p:
        raise bad_request("prompt must not be empty", "prompt")
    elif isinstance(p[0], int):
        items = [p]  # one prompt of token ids
    else:
        items = list(p)
    # NOTE: every text is length-checked before any is tokenized, so a refused batch costs nothing.
    for item in items:
        if isinstance(item, str):
            ctx.check_prompt_chars(item, "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str) and req.echo:
            ctx.require_tokenizer("a text prompt")
            ids, offsets = await ctx.run_sized(len(item), _encode_with_offsets, ctx.tokenizer,
                                               item, req.add_special_tokens)
            prompt = _Prompt(item, ids, offsets)
        elif isinstance(item, str):
            prompt = _Prompt(item, await ctx.encode(item, add_special_tokens=req.add_special_tokens,
                                                    param="prompt"))
        else:
            prompt = _Prompt(None, list(item))
        kept = truncate_prompt(ctx, prompt.token_ids, req.truncate_prompt_tokens,
                               req.truncation_side)
        if len(kept) < len(prompt.token_ids):
            prompt = _Prompt(None, kept)  # NOTE: echo then shows the decoded kept tokens
        if req.echo:
            prompt = await _echo_text(ctx, prompt)
        prompts.append(prompt)
    return prompts


async def create_completion(ctx: ServingContext, req: CompletionRequest,
                            raw: Request) -> Response:
    """Handle one /v1/completions call."""
    check_model(ctx, req.model)
    check_request(ctx, req)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.echo and req.logprobs is not None and req.stream:
        raise bad_request("echo with logprobs is only supported without streaming", "echo")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens 0 is only valid with echo=true (scoring the prompt)",
                          "max_tokens")
    check_prompt_logprobs(req)
    request_id, engine_id = response_id(raw, req, "cmpl")
    prompts = await _parse_prompts(ctx, req)
    structure = requested_structure(req)
    engine_reqs = []
    for i, prompt in enumerate(prompts):
        # NOTE: max_tokens 0 runs one step (the prompt's logprobs come with its first token),
        # and the builder drops what it generated.
        requested = 1 if req.max_tokens == 0 else req.max_tokens
        max_tokens = resolve_max_tokens(ctx, len(prompt.token_ids), requested,
                                        _DEFAULT_MAX_TOKENS, "prompt")
        wanted = [k for k in (req.prompt_logprobs,
                              req.logprobs if req.echo else None) if k is not None]
        params = build_sampling_params(ctx, req, max_tokens=max_tokens, logprobs=req.logprobs,
                                       prompt_logprobs=max(wanted) if wanted else None,
                                       structure=structure)
        engine_reqs.append(EngineRequest(f"{engine_id}-{i}", prompt.token_ids, params,
                                         req.priority))
    stream = await add_requests(ctx, engine_reqs)
    index_of = {r.request_id: i for i, r in enumerate(engine_reqs)}
    builder = _Builder(ctx, req, prompts, index_of, request_id)
    return await respond(raw, stream, builder, req.stream)


class _Builder:
    """Turns DELTA RequestOutputs into OpenAI choices, chunks and usage."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, prompts: list[_Prompt],
                 index_of: dict[str, int], request_id: str) -> None:
        self.ctx, self.req, self.prompts, self.index_of = ctx, req, prompts, index_of
        self.request_id = request_id
        self.created = int(time.time())
        self.token_text = TokenText(ctx.tokenizer, req.return_tokens_as_token_ids)
        self.choices = [_Choice() for _ in range(len(prompts) * req.n)]
        self.cached_tokens = [0] * len(prompts)
        self.prompt_logprobs: list[list[PositionLogprobs | None]] = [[] for _ in prompts]
        self.score_only = req.max_tokens == 0

    def _prompt_text(self, i: int) -> str:
        p = self.prompts[i]
        if p.text is None:
            tok = self.ctx.tokenizer
            p.text = tok.decode(p.token_ids) if tok is not None else ""
        return p.text

    def _absorb(self, out: RequestOutput) -> list[tuple[int, CompletionOutput, str]]:
        """Update the choices; return (choice index, output, new text) for those that moved."""
        i = self.index_of[out.request_id]
        self.cached_tokens[i] = out.num_cached_tokens
        if out.prompt_logprobs:
            self.prompt_logprobs[i].extend(out.prompt_logprobs)
        moved = []
        for c in out.outputs:
            idx = i * self.req.n + c.index
            ch = self.choices[idx]
            if ch.finish_reason is not None:
                continue  # finished earlier; n>1 outputs keep listing it
            if self.score_only:
                # NOTE: max_tokens 0: the one token the engine drew is not part of the answer.
                c = CompletionOutput(index=c.index, text="", token_ids=[], logprobs=None,
                                     finish_reason=("length" if c.finish_reason in ("stop", "length")
                                                    else c.finish_reason))
            text = c.text
            if self.req.echo and not ch.started:
                ch.started = True
                if self.req.logprobs is None or self.req.stream:
                    text = self._prompt_text(i) + text
            if c.logprobs is not None and self.req.logprobs is not None:
                if ch.logprobs is None:
                    ch.logprobs = CompletionLogprobs()
                self._add_logprobs(ch, c.token_ids, c.logprobs)
            ch.text.append(text)
            ch.num_tokens += len(c.token_ids)
            if self.req.return_token_ids:
                ch.token_ids.extend(c.token_ids)
            ch.finish_reason = c.finish_reason
            ch.stop_reason = c.stop_reason
            if text or c.token_ids or c.finish_reason is not None:
                moved.append((idx, c, text))
        return moved

    def _add_logprobs(self, ch: _Choice, token_ids: list[int],
                      positions: list[PositionLogprobs | None]) -> CompletionLogprobs:
        """Append one logprob row per token to ch.logprobs; return just the new rows."""
        new = CompletionLogprobs()
        num = self.req.logprobs or 0
        for tid, pos in zip(token_ids, positions):
            chosen = pos.get(tid) if pos else None
            text = self.token_text(tid, chosen)
            label = self.token_text.label(tid, chosen)
            new.tokens.append(label)
            new.token_logprobs.append(clamp_logprob(chosen.logprob) if chosen else None)
            if pos is None:
                new.top_logprobs.append(None)
            else:
                top = {self.token_text.label(t, lp): clamp_logprob(lp.logprob)
                       for t, lp in top_entries(pos, num)}
                if chosen is not None:
                    top.setdefault(label, clamp_logprob(chosen.logprob))
                new.top_logprobs.append(top)
            new.text_offset.append(ch.text_len)
            ch.text_len += len(text)
        assert ch.logprobs is not None
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(ch.logprobs, name).extend(getattr(new, name))
        return new

    def usage(self) -> Usage:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(ch.num_tokens for ch in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens)))

    async def collect(self, stream: RequestStream) -> CompletionResponse:
        async for out in stream:
            err = output_error(out)
            if err is not None:
                raise err
            self._absorb(out)
        if self.req.echo and self.req.logprobs is not None:
            self._prepend_prompt_logprobs()
        plp = None
        if self.req.prompt_logprobs is not None:
            plp = [prompt_logprob_rows(p.token_ids, rows, self.req.prompt_logprobs, self.token_text)
                   for p, rows in zip(self.prompts, self.prompt_logprobs)]
        ids = self.req.return_token_ids
        choices = [CompletionChoice(index=k, text="".join(ch.text), logprobs=ch.logprobs,
                                    finish_reason=ch.finish_reason, stop_reason=ch.stop_reason,
                                    prompt_logprobs=plp[k // self.req.n] if plp else None,
                                    prompt_token_ids=(self.prompts[k // self.req.n].token_ids
                                                      if ids else None),
                                    token_ids=ch.token_ids if ids else None)
                   for k, ch in enumerate(self.choices)]
        return CompletionResponse(id=self.request_id, model=self.ctx.model_name, choices=choices,
                                  usage=self.usage())

    def _prepend_prompt_logprobs(self) -> None:
        """echo + logprobs: the prompt's tokens (first one has no logprob) lead each choice."""
        for k, ch in enumerate(self.choices):
            i = k // self.req.n
            prompt = self.prompts[i]
            ids = prompt.token_ids
            rows = self.prompt_logprobs[i]
            rows = (rows + [None] * len(ids))[:len(ids)]
            head = _Choice(logprobs=CompletionLogprobs())
            self._add_logprobs(head, ids, rows)
            assert head.logprobs is not None
            text = self._prompt_text(i)
            if prompt.offsets is not None:
                head.logprobs.text_offset = list(prompt.offsets)
            gen = ch.logprobs or CompletionLogprobs()
            shift = len(text)
            head.logprobs.tokens += gen.tokens
            head.logprobs.token_logprobs += gen.token_logprobs
            head.logprobs.top_logprobs += gen.top_logprobs
            head.logprobs.text_offset += [o + shift for o in gen.text_offset]
            ch.logprobs = head.logprobs
            ch.text.insert(0, text)

    async def stream(self, stream: RequestStream) -> AsyncIterator[str]:
        opts = self.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        every_chunk = bool(opts and opts.usage_every_chunk)
        async for out in stream:
            err = output_error(out)
            if err is not None:
                raise err
            lp_before = {k: len(ch.logprobs.tokens) if ch.logprobs else 0
                         for k, ch in enumerate(self.choices)}
            choices = []
            for idx, c, text in self._absorb(out):
                ch = self.choices[idx]
                lps = None
                if ch.logprobs is not None:
                    start = lp_before[idx]
                    lps = CompletionLogprobs(
                        text_offset=ch.logprobs.text_offset[start:],
                        token_logprobs=ch.logprobs.token_logprobs[start:],
                        tokens=ch.logprobs.tokens[start:],
                        top_logprobs=ch.logprobs.top_logprobs[start:])
                prompt_ids = token_ids = None
                if self.req.return_token_ids:
                    token_ids = list(c.token_ids)
                    if not ch.prompt_ids_sent:
                        ch.prompt_ids_sent = True
                        prompt_ids = self.prompts[idx // self.req.n].token_ids
                choices.append(CompletionChoice(index=idx, text=text, logprobs=lps,
                                                finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason,
                                                prompt_token_ids=prompt_ids, token_ids=token_ids))
            if choices:
                yield self._chunk(choices, self.usage() if every_chunk else None, include_usage)
        if include_usage:
            yield self._chunk([], self.usage(), include_usage)
        yield SSE_DONE

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None,
               include_usage: bool) -> str:
        """One SSE chunk; `usage` is left out unless stream_options.include_usage asked for it."""
        # NOTE: prompt_logprobs is never streamed (check_prompt_logprobs), so it is left out too,
        # and so are the token ids unless return_token_ids asked for them.
        left_out = {"prompt_logprobs"}
        if not self.req.return_token_ids:
            left_out |= {"prompt_token_ids", "token_ids"}
        exclude: dict[str, Any] = {"choices": {"__all__": left_out}}
        if not include_usage:
            exclude["usage"] = True
        chunk = CompletionChunk(id=self.request_id, created=self.created,
                                model=self.ctx.model_name, choices=choices, usage=usage)
        return sse(chunk.model_dump_json(exclude=exclude))
