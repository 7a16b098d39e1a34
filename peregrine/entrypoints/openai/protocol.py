"""Pydantic schemas of the OpenAI-compatible API (requests validated here, responses built here)."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from peregrine.sampling_params import MAX_CACHE_SALT_CHARS

# NOTE: OpenAI caps top_logprobs at 20; the same cap bounds the work one request can ask for.
MAX_LOGPROBS = 20
# NOTE: n sequences per prompt. Each may run to max_model_len (chat's default max_tokens is the
# rest of the context), so one request may want n * max_model_len KV tokens; the scheduler runs
# what does not fit in turn (preempting by recompute), so a large n is slow, never stuck.
MAX_N = 16
# OpenAI's documented limits, held by the server unless it runs with --relax-openai-limits (then
# the engine's own bounds in sampling_params.py hold, as they do for the offline LLM).
OPENAI_MAX_TEMPERATURE = 2.0
OPENAI_MAX_STOP_STRINGS = 4
# NOTE: a request id travels into logs and the response id; a bound keeps both readable.
MAX_REQUEST_ID_CHARS = 512

_GUIDED = ("vLLM's older guided decoding fields are not accepted; send structured_outputs "
           "(json, json_object, regex, choice or grammar) or response_format instead")
_FUNCTIONS = "legacy function calling is not implemented; send tools and tool_choice"
_BEAM = "beam search is not implemented by this server"
# Fields OpenAI or vLLM define that this server does not honour: each is refused by name, with
# the reason (see errors.py), instead of being dropped. Anything else unknown is refused as
# OpenAI does ("Unrecognized request argument supplied"). The order is the order of report.
UNSUPPORTED_FIELDS: dict[str, str] = {
    "functions": _FUNCTIONS,
    "function_call": _FUNCTIONS,
    "guided_json": _GUIDED,
    "guided_choice": _GUIDED,
    "guided_regex": _GUIDED,
    "guided_grammar": _GUIDED,
    "guided_decoding_backend": _GUIDED,
    "guided_whitespace_pattern": _GUIDED,
    "structural_tag": "structural tags are not implemented by this server",
    "use_beam_search": _BEAM,
    "length_penalty": _BEAM,
    "audio": "audio output is not implemented; this server generates text only",
    "prediction": "predicted outputs are not implemented by this server",
    "web_search_options": "web search is not implemented by this server",
    "reasoning_effort": "reasoning controls are not implemented by this server",
    "logits_processors": "logits processors cannot be sent in requests",
    "prompt_embeds": "prompt embeddings are not implemented by this server",
    "mm_processor_kwargs": "multimodal input is not implemented by this server",
    "media_io_kwargs": "multimodal input is not implemented by this server",
    "return_mm_kwargs": "multimodal input is not implemented by this server",
    "echo": "chat's echo (the last message prepended to the answer) is not implemented by this "
            "server",
    "watermarking": "watermarking is not implemented by this server",
    "logprob_token_ids": "logprobs of chosen token ids are not implemented; send top_logprobs",
    "return_token_offsets": "token offsets are only for vLLM's render routes, which this server "
                            "does not have",
    "return_prompt_text": "the rendered prompt is not returned; POST /tokenize renders a chat",
    "thinking_token_budget": "thinking budgets are not implemented by this server",
    "repetition_detection": "repetition detection is not implemented by this server",
    "stream_interval": "every engine step is streamed; stream intervals are not implemented",
    "session_id": "session-aware scheduling is not implemented by this server",
    "kv_transfer_params": "disaggregated serving (KV transfer) is not implemented by this server",
    "ec_transfer_params": "disaggregated serving (encoder cache transfer) is not implemented by "
                          "this server",
    "vllm_xargs": "custom request extensions are not implemented by this server",
}


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # NOTE: unknown fields are a 400 naming them, as in OpenAI's API: a field dropped in silence
    # would answer 200 for something the server never did (UNSUPPORTED_FIELDS says why for the
    # ones OpenAI and vLLM define). Known fields accepted only at some values are declared here
    # and checked in serving_common.check_request.
    # NOTE: booleans and integers are strict ("stream": "yes" or "n": "2" is a 400, not a guess);
    # floats refuse NaN and infinity.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's extra: usage in every chunk (with include_usage)

    @property
    def usage_every_chunk(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's structured_outputs request field: exactly one of these (checked by the engine's
    StructuredOutputsParams)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    max_tokens: StrictInt | None = Field(None, ge=1)
    # NOTE: the upper bound depends on --relax-openai-limits (serving_common.check_request).
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # vLLM's extra: with skip_special_tokens false, false joins adjacent special tokens without a
    # space (the detokenizer's rule).
    spaces_between_special_tokens: StrictBool = True
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    priority: StrictInt = 0
    # OpenAI's metadata fields: accepted and ignored (nothing is stored, there are no tiers).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    # vLLM's extras: keep only the last k prompt tokens (-1: the last max_model_len - 1 ones);
    # logprobs of the prompt's tokens (and the top-k at each position), non-streaming only.
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1)
    # vLLM's extra: which end truncate_prompt_tokens cuts ("left", the default, keeps the last
    # tokens; "right" keeps the first).
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's extras: only these token ids may be sampled; words that must not be generated.
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    # vLLM's extras: logprobs name tokens "token_id:N" (for tokens whose text is not valid
    # UTF-8 alone); the response id's suffix (the X-Request-Id header wins, as in vLLM); a salt
    # that keeps this request's prefix-cache blocks apart from those of other salts.
    return_tokens_as_token_ids: StrictBool = False
    # vLLM's extra: answers carry the prompt's token ids and each choice's generated ones.
    return_token_ids: StrictBool = False
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # Known fields we do not implement: accepted only at their no-op value (best_of == n).
    best_of: StrictInt | None = None
    # The text must match: a JSON schema, any JSON object (OpenAI's), or vLLM's kinds.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    # NOTE: 0 with echo scores the prompt (its logprobs) without generating.
    max_tokens: StrictInt | None = Field(None, ge=0)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = None
    # vLLM's extra: text prompts get the tokenizer's special tokens (a BOS) unless this is false.
    add_special_tokens: StrictBool = True


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")  # tool_call_id, name, ... go to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema
    strict: StrictBool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    # vLLM's extras: variables for the chat template; a template of the request's own (refused
    # unless the server runs with --trust-request-chat-template, here or in chat_template_kwargs).
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    # vLLM's extra: documents for retrieval-augmented generation, passed to the chat template
    # (templates that do not read them render as without).
    documents: list[dict[str, str]] | None = None
    modalities: list[str] | None = None  # accepted only as ["text"]
    # vLLM's extra: the rendered chat gets the tokenizer's special tokens on top of what the
    # template wrote (off by default: templates write their own BOS).
    add_special_tokens: StrictBool = False
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM's extra: false leaves the reasoning parser's reasoning_content out of the answer.
    include_reasoning: StrictBool = True


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[StrictInt]


# ----------------------------------------------------------------------------- responses
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str


# vLLM's prompt_logprobs: one entry per prompt token, None for the first; token id -> logprob.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # vLLM's return_token_ids (streamed: the prompt's in a choice's first chunk, then deltas)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's field: the text a reasoning parser split off
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    """A streamed delta; fields left None are left out of the chunk (as OpenAI sends them)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's tokens


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk only


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "peregrine"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
