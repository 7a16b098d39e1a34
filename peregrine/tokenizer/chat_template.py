"""Chat templates rendered with jinja2 the way transformers (5.x) renders them, without importing it.

The environment is the one transformers builds: sandboxed and immutable, `trim_blocks` and
`lstrip_blocks`, loop controls, a `{% generation %}` block (rendered as its body), `tojson` without
HTML escaping, `raise_exception`, `strftime_now`, and a `dict` / `namespace` that refuse
underscore names. Messages lose their None-valued keys, a message's reasoning is also passed as
`reasoning_content` and `thinking`, and the named special tokens are template variables.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_MIN_JINJA2 = (3, 1, 6)


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> Any:
    """The jinja2 template of `source` in transformers' chat-template environment (cached)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # NOTE: templates come from model folders (untrusted); older jinja2 has sandbox escapes.
    found = tuple(int(x) for x in re.findall(r"\d+", jinja2.__version__)[:3])
    if found < _MIN_JINJA2:
        raise ImportError(f"chat templates need jinja2 >= 3.1.6 (sandbox fixes), found "
                          f"{jinja2.__version__}: pip install -U jinja2")

    class GenerationBlock(jinja2.ext.Extension):
        # NOTE: transformers uses this tag to find assistant tokens; rendering only needs the body.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not store an underscore-prefixed name on a namespace: {name!r}")

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def plain_data(value: Any) -> Any:
    """`value` rebuilt from plain JSON-like types (what a sandboxed template may see); any other
    object becomes the placeholder "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    item = getattr(value, "item", None)  # a numpy scalar
    if callable(item) and type(value).__module__ == "numpy":
        return plain_data(item())
    return f"<{type(value).__name__}>"


def _messages(conversation: Any) -> list[dict[str, Any]]:
    """The conversation as plain dicts without None-valued keys; reasoning under every name."""
    out = []
    for message in plain_data(list(conversation)):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat_template(source: str, conversation: Any, *, special_tokens: Mapping[str, str],
                         add_generation_prompt: bool = False,
                         continue_final_message: bool | str = False,
                         tools: list[dict[str, Any]] | None = None,
                         documents: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
    """One conversation rendered with template `source`; `kwargs` are extra template variables
    (they win over the special tokens of the same name)."""
    if not conversation:
        raise ValueError("cannot apply a chat template to an empty conversation")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be JSON schemas (dicts)")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("documents must be a list of dicts with 'title' and 'text' keys")
    template = compile_template(source)
    chat = _messages(conversation)
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = chat[-1].get(field)
        if final is None:
            raise ValueError(f"continue_final_message is set but the final message has no "
                             f"{field!r} to continue")
        fields = [field]
        if field in _REASONING_FIELDS:
            fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
        if not any(f in source for f in fields):
            raise ValueError(f"continue_final_message is set to {field!r} but the chat template "
                             "never reads that field")
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but the final message has no "
                                 "text to continue")
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    variables = plain_data({**special_tokens, **kwargs})
    text = template.render(messages=chat, tools=plain_data(tools), documents=plain_data(documents),
                           add_generation_prompt=add_generation_prompt, **variables)
    if final is not None:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ValueError("continue_final_message is set but the chat template dropped (part "
                             "of) the final message")
        at = text.rindex(tag)
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG \
            else text[:at].rstrip()
    return text
