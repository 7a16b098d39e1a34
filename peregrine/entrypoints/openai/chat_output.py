"""A chat choice's generated text split into reasoning, content and tool calls: whole (for a
response) or delta by delta (for a stream), with the same parsers either way."""
from __future__ import annotations

from peregrine.entrypoints.openai.protocol import (DeltaFunctionCall, DeltaToolCall, FunctionCall,
                                                   ToolCall)
from peregrine.entrypoints.openai.reasoning_parsers import ReasoningParser
from peregrine.entrypoints.openai.tool_parsers import ToolParser


class ChoiceOutput:
    """The parsers one choice goes through: reasoning first, then tool calls in what is left."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 prompt_tail: str, parallel_tool_calls: bool = True) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.prompt_tail = prompt_tail
        self.parallel = parallel_tool_calls
        self._splitter = reasoning.start(prompt_tail) if reasoning is not None else None
        self._text = ""  # the content (after reasoning) seen by the tool parser so far
        self._content_sent = 0
        self._call_ids: list[str] = []
        self._args_sent: list[int] = []

    # ------------------------------------------------------------------ whole output
    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning_content, content, tool_calls) of a complete output."""
        reasoning, content = (self.reasoning.split(self.prompt_tail, text)
                              if self.reasoning is not None else (None, text))
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, parsed = self.tools.extract(content)
            if not self.parallel:
                parsed = parsed[:1]
            calls = [ToolCall(id=self.tools.make_call_id(),
                              function=FunctionCall(name=c.name or "", arguments=c.arguments))
                     for c in parsed]
        if reasoning is not None and not content:
            content = None
        return reasoning, content, calls

    # ------------------------------------------------------------------ streaming
    @property
    def called_tools(self) -> bool:
        """Whether the stream has sent a tool call."""
        return bool(self._call_ids)

    def feed(self, text: str, final: bool) -> tuple[str, str, list[DeltaToolCall]]:
        """(reasoning delta, content delta, tool call deltas) for the next piece of text."""
        reasoning, content = "", text
        if self._splitter is not None:
            reasoning, content = self._splitter.feed(text)
            if final:
                more_reasoning, more_content = self._splitter.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self.tools is None:
            return reasoning, content, []
        content, calls = self._feed_tools(content, final)
        return reasoning, content, calls

    def _feed_tools(self, piece: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        assert self.tools is not None
        self._text += piece
        parsed = self.tools.parse(self._text, final)
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        end = parsed.content_end
        if final and (not parsed.valid or not all(c.done for c in calls)):
            # NOTE: the text ends in a malformed call: no new call starts now, and if none was
            # sent the whole text was content (as the whole response would say).
            calls = calls[:len(self._call_ids)]
            if not self._call_ids:
                end = len(self._text)
        elif not final or calls:
            # NOTE: whitespace before a call is not content (the whole answer drops it too), so
            # trailing whitespace waits until text or the end of the output decides.
            end = len(self._text[:end].rstrip())
        content = self._text[self._content_sent:end] if end > self._content_sent else ""
        self._content_sent = max(self._content_sent, end)
        deltas: list[DeltaToolCall] = []
        for i, call in enumerate(calls):
            if i == len(self._call_ids):
                if call.name is None:
                    break
                self._call_ids.append(self.tools.make_call_id())
                self._args_sent.append(0)
                deltas.append(DeltaToolCall(index=i, id=self._call_ids[i], type="function",
                                            function=DeltaFunctionCall(name=call.name,
                                                                       arguments="")))
            new = call.arguments[self._args_sent[i]:]
            if not new:
                continue
            self._args_sent[i] = len(call.arguments)
            if deltas and deltas[-1].index == i:
                deltas[-1].function.arguments = (deltas[-1].function.arguments or "") + new
            else:
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=new)))
        return content, deltas
