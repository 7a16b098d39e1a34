"""Incremental detokenization of one sequence: text deltas without U+FFFD, and stop strings."""
from __future__ import annotations

import functools
import weakref
from typing import Any

from peregrine.sampling_params import SamplingParams

# NOTE: how many prompt tokens open the first decode window. Tokenizers such as SentencePiece drop the
# leading space of the first decoded token; with real left context the first output token keeps it.
_PROMPT_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


def _decoder(tokenizer: Any, skip_special_tokens: bool):
    """ids -> str over a short window: the Rust backend when there is one (no Python cleanup pass)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


_ADDED_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _added_tokens(tokenizer: Any) -> dict[int, str]:
    """Token id -> text of the tokenizer's added tokens (special or not), built once per tokenizer."""
    try:
        return _ADDED_TOKENS[tokenizer]
    except (KeyError, TypeError):
        pass
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    added = {int(tid): str(getattr(tok, "content", tok)) for tid, tok in decoder.items()}
    try:
        _ADDED_TOKENS[tokenizer] = added
    except TypeError:  # NOTE: not weak-referenceable: build it per request instead
        pass
    return added


class IncrementalDetokenizer:
    """Turns a sequence's output token ids into text step by step and watches for stop strings.

    Two offsets into the recent token ids delimit the decode window: tokens in [prefix, read) are
    already rendered and give context; tokens from `read` on are new. Each step decodes only that window,
    so the cost per token does not grow with the sequence. A window whose text ends in U+FFFD stops in the
    middle of a UTF-8 character and is held back until the character is complete.

    With special tokens kept and `spaces_between_special_tokens` false, an added token right after
    another one renders as its own text alone, without the space some decoders (WordPiece, ...) put
    between tokens: the rule vLLM applies.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._decode = _decoder(tokenizer, params.skip_special_tokens)
        # Added tokens by id, only when adjacent ones must be joined without a space.
        self._added: dict[int, str] | None = None
        if not params.skip_special_tokens and not params.spaces_between_special_tokens:
            self._added = _added_tokens(tokenizer) or None
        self._last_added = False  # whether the last output token was an added token
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self._stops = StopStringMatcher(self.stop) if self.stop else None
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0  # index into _ids: start of the decode window
        self._read = len(self._ids)  # index into _ids: first token not yet rendered into output_text
        self._prefix_text: str | None = None  # decode of _ids[_prefix:_read], cached
        self.output_text = ""
        self.stop_reason: str | None = None  # the stop string found, once one is
        self._num_sent = 0  # characters of output_text already returned by get_delta_text

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens to the text; return the stop string matched by them, or None."""
        if self.stop_reason is not None:
            return None
        start = len(self.output_text)
        new_text = "".join([self._render(tok) for tok in new_token_ids])
        self.output_text += new_text
        if self._stops is None or not new_text:
            return None
        match = self._stops.feed(new_text, start)
        return self._cut_at(*match) if match is not None else None

    def get_delta_text(self, final: bool = False) -> str:
        """Text added since the last call; holds back a possible stop-string prefix unless `final`."""
        end = len(self.output_text) if final or self.stopped else self._stable_length()
        end = max(end, self._num_sent)
        delta = self.output_text[self._num_sent:end]
        self._num_sent = end
        return delta

    def get_output_text(self, final: bool = False) -> str:
        """All text so far, without a trailing possible stop-string prefix unless `final` (for streaming)."""
        if final or self.stopped:
            return self.output_text
        return self.output_text[:max(self._stable_length(), self._num_sent)]

    def _render(self, token_id: int) -> str:
        """Add one token to the window; return the new complete text it unlocks (maybe '')."""
        if self._added is not None:
            content = self._added.get(token_id)
            follows_added, self._last_added = self._last_added, content is not None
            if content is not None and follows_added and self._read == len(self._ids):
                # NOTE: everything before it is rendered, so its text is exactly its content.
                self._ids[:] = [token_id]
                self._prefix, self._read = 0, 1
                self._prefix_text = None
                return content
        self._ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Nothing visible yet (a skipped special token) or a UTF-8 character still incomplete.
            return ""
        delta = new_text[len(self._prefix_text):]
        # The tokens just rendered become the next window's context; older ones are no longer needed.
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        self._prefix_text = None
        return delta

    def _cut_at(self, i: int, s: str) -> str:
        """Truncate the text at the stop string `s` found at index `i`; return `s`."""
        end = i + len(s) if self.include_stop_str_in_output else i
        self.output_text = self.output_text[:end]
        # NOTE: never needed when deltas went through the hold-back, but keeps slicing safe if not.
        self._num_sent = min(self._num_sent, len(self.output_text))
        self.stop_reason = s
        return s

    def _stable_length(self) -> int:
        """Length of output_text minus its longest suffix that is a proper prefix of a stop string."""
        held = self._stops.held if self._stops is not None else 0
        return len(self.output_text) - held


@functools.lru_cache(maxsize=256)
def _borders(s: str) -> tuple[int, ...]:
    """KMP table: entry i is the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    table = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        if s[i] == s[k]:
            k += 1
        table[i] = k
    return tuple(table)


class StopStringMatcher:
    """Finds stop strings in text that arrives piece by piece, in time linear in each piece.

    Per stop string it keeps one KMP state: the length of the longest suffix of the text so far that is
    a prefix of that stop string. A new piece only advances these states, so the text before it is never
    scanned again, and the longest state is exactly the tail that streaming must hold back.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(stops)
        self._tables = [_borders(s) for s in self.stops]
        self._states = [0] * len(self.stops)
        self.chars_scanned = 0  # characters examined, KMP fall-backs included (for tests and stats)

    @property
    def held(self) -> int:
        """Length of the text's longest suffix that is a proper prefix of a stop string."""
        return max(self._states, default=0)

    def feed(self, piece: str, offset: int) -> tuple[int, str] | None:
        """Scan `piece`, which starts at `offset` of the whole text; return (start, stop string) of the
        earliest-starting match that ends inside it (ties: the first in the list), or None."""
        best: tuple[int, str] | None = None
        for j, s in enumerate(self.stops):
            state, end, work = _advance(s, self._tables[j], self._states[j], piece)
            self._states[j] = state
            self.chars_scanned += work
            if end != -1:
                start = offset + end - len(s)
                if best is None or start < best[0]:
                    best = (start, s)
        return best


def _advance(s: str, table: tuple[int, ...], state: int, piece: str) -> tuple[int, int, int]:
    """Run one stop string's KMP state over `piece`: (new state, index just past the first full match or
    -1, characters examined)."""
    n, i, size, work = len(s), 0, len(piece), 0
    while i < size:
        if state == 0:
            # NOTE: outside a partial match, jump to the next possible start (str.find runs in C).
            j = piece.find(s[0], i)
            work += (size if j == -1 else j + 1) - i
            if j == -1:
                return 0, -1, work
            state, i = 1, j + 1
        else:
            ch = piece[i]
            work += 1
            while state and ch != s[state]:
                state = table[state - 1]
                work += 1
            if ch == s[state]:
                state += 1
            i += 1
        if state == n:
            return state, i, work
    return state, -1, work


def decode_logprob_tokens(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Each token decoded on its own (for Logprob.decoded_token); special tokens are kept."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode_batch([[t] for t in token_ids], skip_special_tokens=False)
    return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
