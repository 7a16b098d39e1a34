"""Mistral calls: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] and the newer
[TOOL_CALLS]name[ARGS]{...} (repeated per call). Both markers are special tokens."""
from __future__ import annotations

import secrets
import string

from peregrine.entrypoints.openai.tool_parsers.base import (PartialCall, ToolParse, ToolParser,
                                                            call_from_object, finish_call,
                                                            held_prefix, skip_ws, value_end)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def make_call_id(self) -> str:
        # NOTE: Mistral's chat templates accept only 9 alphanumeric characters as a call id.
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def parse(self, text: str, final: bool) -> ToolParse:
        first = text.find(TOOL_CALLS)
        if first < 0:
            return ToolParse(len(text) - (0 if final else held_prefix(text, TOOL_CALLS)))
        parsed = ToolParse(first)
        i = skip_ws(text, first + len(TOOL_CALLS))
        if i >= len(text):
            parsed.valid = not final
            return parsed
        try:
            done = self._array(text, i, parsed) if text[i] == "[" else self._named(text, i, parsed)
        except ValueError:
            parsed.valid = False
            return parsed
        parsed.valid = done or not final
        return parsed

    def _array(self, text: str, i: int, parsed: ToolParse) -> bool:
        i = skip_ws(text, i + 1)
        while i < len(text):
            if text[i] == "]":
                return True
            if text[i] == "," and parsed.calls:
                i = skip_ws(text, i + 1)
                continue
            call, end = call_from_object(text, i)
            parsed.calls.append(call)
            if end is None:
                return False
            i = skip_ws(text, end)
        return False

    def _named(self, text: str, i: int, parsed: ToolParse) -> bool:
        while True:
            k = text.find(ARGS, i)
            if k < 0:
                return False  # the name is still being written
            call = PartialCall(name=text[i:k].strip())
            parsed.calls.append(call)
            j = skip_ws(text, k + len(ARGS))
            if j >= len(text):
                return False
            if text[j] != "{":
                raise ValueError("tool call arguments must be a JSON object")
            end = value_end(text, j)
            call.arguments = text[j:end if end is not None else len(text)]
            if end is None:
                return False
            finish_call(call, True)
            i = skip_ws(text, end)
            if not text.startswith(TOOL_CALLS, i):
                return True
            i = skip_ws(text, i + len(TOOL_CALLS))
