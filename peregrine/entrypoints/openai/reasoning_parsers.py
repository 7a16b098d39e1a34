"""Reasoning parsers: a model's `<think>...</think>` text goes to `reasoning_content`, the rest to
`content`, in whole responses and in streamed deltas alike (one state machine for both, so a
stream's deltas always add up to the whole response)."""
from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """How a model family marks its reasoning."""

    name: str
    # True: the output starts inside the reasoning even without an opening tag (DeepSeek-R1's
    # template opens it in the prompt). False: only if the prompt ends with the opening tag
    # (Qwen3's template with thinking on) or the output starts with it.
    always_starts_in_reasoning: bool

    def start(self, prompt_tail: str) -> ReasoningSplitter:
        """A splitter for one choice, given the end of its rendered prompt."""
        opened = prompt_tail.rstrip().endswith(THINK_OPEN)
        return ReasoningSplitter(self.always_starts_in_reasoning or opened)

    def split(self, prompt_tail: str, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole output."""
        splitter = self.start(prompt_tail)
        r1, c1 = splitter.feed(text)
        r2, c2 = splitter.finish()
        return (r1 + r2 if splitter.saw_reasoning else None), c1 + c2


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3", always_starts_in_reasoning=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", always_starts_in_reasoning=True),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered under `name`; ValueError naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Feeds text deltas, returns (reasoning delta, content delta); tags split across deltas
    are held back until they are decided."""

    def __init__(self, in_reasoning: bool) -> None:
        self._default_reasoning = in_reasoning
        self._phase = "open"  # open -> reasoning -> after -> content (or open -> content)
        self._buf = ""
        self.saw_reasoning = in_reasoning
        self._started = False  # reasoning text seen (its leading whitespace is dropped)

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning = content = ""
        if self._phase == "open":
            head = self._buf.lstrip()
            if head.startswith(THINK_OPEN):
                self._buf, self._phase, self.saw_reasoning = head[len(THINK_OPEN):], "reasoning", True
            elif THINK_OPEN.startswith(head):
                return "", ""  # whitespace or part of the tag so far: undecided
            else:
                self._phase = "reasoning" if self._default_reasoning else "content"
        if self._phase == "reasoning" and not self._started:
            self._buf = self._buf.lstrip()  # NOTE: the newline after the opening tag
            if not self._buf:
                return "", ""
            self._started = True
        if self._phase == "reasoning":
            end = self._buf.find(THINK_CLOSE)
            if end < 0:
                keep = _held_prefix(self._buf, THINK_CLOSE)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            reasoning, self._buf = self._buf[:end], self._buf[end + len(THINK_CLOSE):]
            self._phase = "after"
        if self._phase == "after":
            # NOTE: the blank lines a model writes after its reasoning are not part of the answer.
            self._buf = self._buf.lstrip()
            if not self._buf:
                return reasoning, ""
            self._phase = "content"
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Flush what was held back at the end of the output."""
        rest, self._buf = self._buf, ""
        if self._phase == "reasoning" or (self._phase == "open" and self._default_reasoning):
            return rest, ""
        return "", "" if self._phase == "after" else rest
