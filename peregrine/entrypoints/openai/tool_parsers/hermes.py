"""Hermes-style calls (Qwen2.5, Qwen3, Hermes): <tool_call>{"name": ..., "arguments": {...}}</tool_call>."""
from __future__ import annotations

from peregrine.entrypoints.openai.tool_parsers.base import (ToolParse, ToolParser,
                                                            append_call, held_prefix, skip_ws)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ToolParse:
        first = text.find(OPEN)
        if first < 0:
            return ToolParse(len(text) - (0 if final else held_prefix(text, OPEN)))
        parsed = ToolParse(first)
        i = first
        while True:
            j = skip_ws(text, i + len(OPEN))
            if j >= len(text):
                parsed.valid = not final
                return parsed
            end = append_call(parsed, text, j, final)
            if end is None:
                return parsed
            k = skip_ws(text, end)
            if text.startswith(CLOSE, k):
                k += len(CLOSE)
            nxt = text.find(OPEN, k)
            if nxt < 0:
                return parsed
            i = nxt
