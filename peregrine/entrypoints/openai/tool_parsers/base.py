"""The tool parser interface, and a JSON scanner that reads an object as far as the text goes (so
streamed arguments can be sent while the model is still writing them)."""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

_WS = " \t\r\n"
_SCALAR = re.compile(r"[^\s,}\]]*")


@dataclass
class PartialCall:
    """One tool call as far as the text goes."""

    name: str | None = None  # known once its JSON string is complete
    # The arguments' JSON text as the model wrote it so far; each parse of a longer text extends it.
    arguments: str = ""
    done: bool = False  # the call is complete and valid


@dataclass
class ToolParse:
    content_end: int  # text[:content_end] is plain content, safe to show
    calls: list[PartialCall] = field(default_factory=list)
    valid: bool = True  # False: the calls' text is malformed (the whole text is then content)


class ToolParser(ABC):
    """Turns a model's tool-call text (its own format) into calls."""

    name: str
    # NOTE: formats whose markers are special tokens need them kept in the decoded text.
    needs_special_tokens: bool = False

    @abstractmethod
    def parse(self, text: str, final: bool) -> ToolParse:
        """Content and calls of `text`; `final`: the output is complete (nothing is held back)."""

    def extract(self, text: str) -> tuple[str | None, list[PartialCall]]:
        """(content or None, calls) of a whole output; no valid calls: the text is the content."""
        parsed = self.parse(text, final=True)
        if not parsed.valid or not parsed.calls or not all(c.done for c in parsed.calls):
            return text, []
        return (text[:parsed.content_end].rstrip() or None), parsed.calls

    def make_call_id(self) -> str:
        import uuid
        return f"call_{uuid.uuid4().hex[:24]}"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


# NOTE: regexes walk strings and jump between brackets in C: a streamed call is rescanned on
# every delta, so a Python loop per character would grow with the square of its length.
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.S)  # possessive: no backtracking
_BRACKET_OR_QUOTE = re.compile(r'["{}\[\]]')


def _string_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string opening at text[i] == '"'; None if the text ends first."""
    m = _STRING.match(text, i)
    return m.end() if m else None


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i]; None if the text ends first."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while True:
            m = _BRACKET_OR_QUOTE.search(text, j)
            if m is None:
                return None
            j = m.start()
            if m.group() == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            depth += 1 if m.group() in "{[" else -1
            if depth == 0:
                return j + 1
            j += 1
    end = _SCALAR.match(text, i).end()
    return None if end == len(text) else end


def scan_object(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The object opening at text[i] == '{': key -> (value start, value end or None), and the
    object's end (None if the text ends first). ValueError when it is not JSON."""
    fields: dict[str, tuple[int, int | None]] = {}
    if text[i] != "{":
        raise ValueError("not a JSON object")
    i = skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "}":
            return fields, i + 1
        if text[i] == "," and fields:
            i = skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            raise ValueError("expected a key")
        key_end = _string_end(text, i)
        if key_end is None:
            return fields, None
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            break
        if text[i] != ":":
            raise ValueError("expected ':'")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            break
        end = value_end(text, i)
        fields[key] = (i, end)
        if end is None:
            break
        i = skip_ws(text, end)
    return fields, None


def arguments_so_far(text: str, span: tuple[int, int | None] | None) -> str:
    """The arguments' text: an object as written (so far); a JSON string holding an object,
    decoded, once complete; nothing else."""
    if span is None:
        return ""
    start, end = span
    if text[start] == "{":
        return text[start:end if end is not None else len(text)]
    if text[start] == '"' and end is not None:
        return json.loads(text[start:end])
    return ""


def finish_call(call: PartialCall, has_arguments: bool) -> PartialCall:
    """Mark a complete call done after checking it: a string name, arguments a JSON object."""
    if not isinstance(call.name, str) or not call.name:
        raise ValueError("a tool call needs a name")
    if not has_arguments:
        call.arguments = "{}"
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError as e:
        raise ValueError(f"tool call arguments are not JSON: {e}") from None
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be a JSON object")
    call.done = True
    return call


def call_from_object(text: str, i: int, args_keys: tuple[str, ...] = ("arguments", "parameters")
                     ) -> tuple[PartialCall, int | None]:
    """A {"name": ..., "arguments": {...}} object at text[i]: the call so far and the object's end."""
    fields, end = scan_object(text, i)
    call = PartialCall()
    name_span = fields.get("name")
    if name_span is not None and name_span[1] is not None:
        name = json.loads(text[name_span[0]:name_span[1]])
        if not isinstance(name, str):
            raise ValueError("a tool call's name must be a string")
        call.name = name
    key = next((k for k in args_keys if k in fields), None)
    call.arguments = arguments_so_far(text, fields.get(key) if key else None)
    if end is not None:
        finish_call(call, key is not None)
    return call, end


def append_call(parsed: ToolParse, text: str, i: int, final: bool,
                args_keys: tuple[str, ...] = ("arguments", "parameters")) -> int | None:
    """Parse the call object at text[i] into parsed.calls; the index after it, or None when
    parsing stops here (then parsed.valid says whether the text so far is a good prefix)."""
    try:
        call, end = call_from_object(text, i, args_keys)
    except ValueError:
        parsed.valid = False
        return None
    parsed.calls.append(call)
    if end is None:
        parsed.valid = not final
    return end
