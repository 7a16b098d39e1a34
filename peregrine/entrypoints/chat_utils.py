"""Rendering a conversation with a chat template: shared by the offline LLM and the server."""
from __future__ import annotations

from typing import Any

# NOTE: apply_chat_template's own parameters. Sent as template variables they would change how it
# runs (tokenize, truncate, another template), so callers refuse them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer ships a chat template of its own."""
    return bool(getattr(tokenizer, "chat_template", None))


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], *,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        chat_template: str | None = None,
                        template_kwargs: dict[str, Any] | None = None,
                        tools: list[dict[str, Any]] | None = None,
                        documents: list[dict[str, str]] | None = None) -> str:
    """The conversation as prompt text, rendered with `chat_template` or the tokenizer's own
    (`tools`: OpenAI tool definitions, for templates that describe them to the model;
    `documents`: retrieval results, for templates that show them)."""
    if chat_template is None and not has_chat_template(tokenizer):
        raise ValueError("the tokenizer has no chat template; pass chat_template=...")
    if not messages:
        raise ValueError("the conversation has no messages")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError("each chat message must be a dict with 'role' and 'content'")
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise ValueError("continue_final_message needs an assistant message last")
    reserved = sorted(set(template_kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"template_kwargs may not set {reserved[0]!r}")
    return tokenizer.apply_chat_template(
        messages, tokenize=False, chat_template=chat_template,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message, tools=tools, documents=documents,
        **(template_kwargs or {}))


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                chat_template: str | None = None) -> list[int]:
    """Token ids of a conversation rendered with the (given or the tokenizer's) chat template."""
    text = apply_chat_template(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                               chat_template=chat_template)
    # NOTE: the template already holds any special tokens (bos); do not add them twice.
    return tokenizer.encode(text, add_special_tokens=False)
