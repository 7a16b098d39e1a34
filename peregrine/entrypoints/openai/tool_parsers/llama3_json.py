"""Llama 3.x JSON calls: the output is {"name": ..., "parameters": {...}} (after an optional
<|python_tag|>), several separated by ';'."""
from __future__ import annotations

from peregrine.entrypoints.openai.tool_parsers.base import (ToolParse, ToolParser,
                                                            append_call, skip_ws)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ToolParse:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return ToolParse(0)  # undecided: empty, whitespace or part of the tag
        if i >= len(text) or text[i] != "{":
            return ToolParse(len(text))
        parsed = ToolParse(0)
        while True:
            end = append_call(parsed, text, i, final, ("parameters", "arguments"))
            if end is None:
                return parsed
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            if i >= len(text):
                return parsed
            if text[i] != "{":
                parsed.valid = False  # text after the calls that is not another call
                return parsed
