"""Calls the server forces through constrained decoding (tool_choice "required" or a named
function): the grammar's JSON schema, and parsers for the text it lets through."""
from __future__ import annotations

from typing import Any

from peregrine.entrypoints.openai.tool_parsers.base import (PartialCall, ToolParse, ToolParser,
                                                            finish_call, skip_ws, value_end)
from peregrine.entrypoints.openai.tool_parsers.mistral import MistralToolParser

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or _ANY_OBJECT


def named_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A named function: the whole output is its arguments object."""
    return _parameters(function)


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": a JSON array of one or more {"name", "parameters"} calls."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [f["name"]]},
                             "parameters": _parameters(f)},
              "required": ["name", "parameters"]} for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedToolParser(ToolParser):
    """The output is the arguments of one call to `function_name`."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ToolParse:
        i = skip_ws(text, 0)
        parsed = ToolParse(0)
        if i >= len(text):
            parsed.valid = not final
            return parsed
        if text[i] != "{":
            parsed.valid = False
            return parsed
        end = value_end(text, i)
        call = PartialCall(self.function_name, text[i:end if end is not None else len(text)])
        parsed.calls.append(call)
        if end is None:
            parsed.valid = not final
            return parsed
        try:
            finish_call(call, True)
        except ValueError:
            parsed.valid = False
        return parsed


class RequiredToolParser(MistralToolParser):
    """The output is a JSON array of {"name", "parameters"} calls (no marker before it)."""

    name = "required"
    needs_special_tokens = False

    def make_call_id(self) -> str:
        return ToolParser.make_call_id(self)

    def parse(self, text: str, final: bool) -> ToolParse:
        parsed = ToolParse(0)
        i = skip_ws(text, 0)
        if i >= len(text):
            parsed.valid = not final
            return parsed
        if text[i] != "[":
            parsed.valid = False
            return parsed
        try:
            done = self._array(text, i, parsed)
        except ValueError:
            parsed.valid = False
            return parsed
        parsed.valid = done or not final
        return parsed
