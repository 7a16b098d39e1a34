"""Tool-call parsers by name (`--tool-call-parser`): each turns one model family's tool-call
text into OpenAI tool calls, whole or streamed."""
from __future__ import annotations

from peregrine.entrypoints.openai.tool_parsers.base import PartialCall, ToolParse, ToolParser
from peregrine.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from peregrine.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from peregrine.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered under `name`; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "PartialCall", "ToolParse", "ToolParser", "get_tool_parser"]
