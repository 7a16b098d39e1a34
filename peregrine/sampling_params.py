"""User-facing sampling parameters, validated on construction."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from peregrine.structured_output.params import StructuredOutputsParams


MAX_LOGPROBS = 20  # top-N logprobs per position, as in OpenAI's API
# NOTE: stop strings are matched on every decode step; these bound that work and the hold-back.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
# NOTE: every bad word becomes up to two token sequences matched against the recent output on
# every step; these bound that work and the device ring of recent tokens (see sample/constraints.py).
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 64  # tokens in one tokenized bad word (checked where it is tokenized)
# NOTE: OpenAI allows [0, 2]; vLLM has no bound. Past ~100 the distribution is uniform anyway, and
# a bound keeps 1 / temperature and logits / temperature far from overflow and underflow.
MAX_TEMPERATURE = 100.0
MAX_CACHE_SALT_CHARS = 1024  # vLLM's bound on cache_salt


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text and tokens so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to sample one request's completions (names as in vLLM)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # False: the output carries token ids only (no text, no logprob token strings), which saves
    # the per-token detokenization; stop strings need the text, so they need True.
    detokenize: bool = True
    # With skip_special_tokens False: False renders two adjacent added tokens of the output with
    # nothing between them, even where the tokenizer's decoder would put a space (vLLM's rule).
    spaces_between_special_tokens: bool = True
    # Requests with different salts never share prefix-cache blocks (the salt enters every block
    # hash of the request); equal salts, or none, share as usual.
    cache_salt: str | None = None
    # token id -> added to that token's logit before sampling, in [-100, 100] (as in OpenAI's API)
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (non-empty; each in [0, vocab), checked by the engine).
    allowed_token_ids: list[int] | None = None
    # Words that must not be generated: the front end tokenizes each one as-is and after a space.
    bad_words: list[str] | None = None
    # The text must match a JSON schema, a regex, a choice or a grammar (compiled by the front end).
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled from generation_config.json for fields the user did not set; see `with_defaults`.
    _user_set: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    # The token sequences of `bad_words`, filled by the front end (`with_bad_word_tokens`).
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, msg: str) -> ValueError:
            return ValueError(f"{name} {msg}")
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or (value is not None and not isinstance(value, int)):
                raise bad(name, f"must be an integer, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
                    or math.isinf(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if any(not isinstance(s, str) for s in self.stop):
            raise bad("stop", "must be a string or a list of strings")
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise bad("stop", f"strings must be at most {MAX_STOP_STRING_CHARS} characters, got one of "
                      f"{longest}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", f"must be a boolean, got {self.detokenize!r}")
        if self.stop and not self.detokenize:
            raise bad("stop", "strings are matched on the output text: they need detokenize=True")
        if not isinstance(self.spaces_between_special_tokens, bool):
            raise bad("spaces_between_special_tokens",
                      f"must be a boolean, got {self.spaces_between_special_tokens!r}")
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt
                                 or len(salt) > MAX_CACHE_SALT_CHARS):
            raise bad("cache_salt", f"must be a non-empty string of at most "
                      f"{MAX_CACHE_SALT_CHARS} characters, got {salt!r:.64}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", f"must map token ids to numbers, got {self.logit_bias!r}")
            for tok, value in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                    raise bad("logit_bias", f"keys must be token ids >= 0, got {tok!r}")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                        not -100.0 <= value <= 100.0:
                    raise bad("logit_bias", f"values must be numbers in [-100, 100], got {value!r}")
        self._validate_token_constraints(bad)
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise bad("structured_outputs", f"must be a StructuredOutputsParams, got {so!r}")
            if self.min_tokens:
                # NOTE: the grammar alone decides where the text may end (it allows eos there).
                raise bad("min_tokens", "cannot be combined with structured_outputs")

    def _validate_token_constraints(self, bad: Callable[[str, str], ValueError]) -> None:
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, list) or not allowed:
                raise bad("allowed_token_ids", f"must be a non-empty list of token ids, got {allowed!r}")
            for tok in allowed:
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                    raise bad("allowed_token_ids", f"must hold token ids >= 0, got {tok!r}")
        words = self.bad_words
        if words is not None:
            if not isinstance(words, list) or any(not isinstance(w, str) for w in words):
                raise bad("bad_words", f"must be a list of strings, got {words!r}")
            if any(not w for w in words):
                raise bad("bad_words", "must not contain empty strings")
            if len(words) > MAX_BAD_WORDS:
                raise bad("bad_words", f"may hold at most {MAX_BAD_WORDS} words, got {len(words)}")
            longest = max((len(w) for w in words), default=0)
            if longest > MAX_BAD_WORD_CHARS:
                raise bad("bad_words", f"entries must be at most {MAX_BAD_WORD_CHARS} characters, got "
                          f"one of {longest}")
        seqs = self._bad_words_token_ids
        if seqs is not None:
            if not isinstance(seqs, list) or any(
                    not isinstance(q, list) or not q or len(q) > MAX_BAD_WORD_TOKENS
                    or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in q)
                    for q in seqs):
                raise bad("bad_words", f"token sequences must be lists of 1 to {MAX_BAD_WORD_TOKENS} "
                          f"token ids >= 0, got {seqs!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    def with_generation_defaults(self, gen_cfg: dict[str, Any], user_set: set[str] | None) -> SamplingParams:
        """Apply generation_config.json defaults (temperature, top_p, top_k, ...) to unset fields."""
        mapping = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
        if not gen_cfg or user_set is None:
            return self
        updates = {ours: gen_cfg[theirs] for theirs, ours in mapping.items()
                   if theirs in gen_cfg and ours not in user_set and gen_cfg[theirs] is not None}
        if gen_cfg.get("do_sample") is False and "temperature" not in user_set:
            updates["temperature"] = 0.0
        if not updates:
            return self
        import dataclasses
        return dataclasses.replace(self, **updates)

    def with_bad_word_tokens(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """A copy holding the token sequences of `bad_words`: each word encoded as-is and after a
        space (`encode` adds no special tokens); duplicates once."""
        seqs: list[list[int]] = []
        for word in self.bad_words or ():
            for text in (word, " " + word):
                ids = list(encode(text))
                if not ids:
                    raise ValueError(f"bad_words: {text!r} encodes to no tokens")
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise ValueError(f"bad_words: {word!r} encodes to {len(ids)} tokens, more than "
                                     f"{MAX_BAD_WORD_TOKENS}")
                if ids not in seqs:
                    seqs.append(ids)
        import dataclasses
        return dataclasses.replace(self, _bad_words_token_ids=seqs if self.bad_words else None)

    def clone(self) -> SamplingParams:
        import copy
        return copy.deepcopy(self)
