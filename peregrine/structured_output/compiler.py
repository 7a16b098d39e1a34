"""Grammar compilation with xgrammar, in the front end, cached by canonical text.

The front end compiles a request's grammar in `LLMEngine.add_request`, so a malformed schema, regex
or grammar is a ValueError there (a 400 from the server) and the engine core's step loop never
compiles. The server's AsyncEngine compiles in a worker thread before it queues the request, so
the engine thread's add_request finds the grammar in the cache. The compiled grammar travels to the core inside the `EngineCoreRequest`; when the core
runs in another process it is pickled as xgrammar's JSON and rebuilt against a tokenizer info that
the core's process builds once from the same tokenizer folder.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from peregrine.structured_output.params import StructuredOutputsParams

# NOTE: compiled grammars of JSON schemas can hold per-token masks: keep a bounded number.
CACHE_SIZE = 256


def import_xgrammar() -> Any:
    """The xgrammar module, or a ValueError saying how to install it."""
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured_outputs needs the xgrammar package: "
                         "pip install 'peregrine-llm[structured]'") from e
    return xgrammar


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _clean(e: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    return _NATIVE_PREFIX.sub("", str(e).strip()).strip()


class CompiledStructure:
    """A compiled grammar (xgrammar) and what a matcher for it needs; picklable."""

    def __init__(self, grammar: Any, kind: str, tokenizer_key: tuple) -> None:
        self.grammar = grammar  # xgrammar.CompiledGrammar
        self.kind = kind
        self.tokenizer_key = tokenizer_key  # (tokenizer folder, vocab size, stop ids)

    def new_matcher(self) -> Any:
        """A fresh xgrammar.GrammarMatcher at the start of the text."""
        return import_xgrammar().GrammarMatcher(self.grammar)

    def __reduce__(self):
        # NOTE: xgrammar objects do not pickle; its JSON form does, and the tokenizer info is rebuilt
        # once per process from the tokenizer folder.
        return (_rebuild, (self.grammar.serialize_json(), self.kind, self.tokenizer_key))


_INFOS: dict[tuple, Any] = {}
_INFOS_LOCK = threading.Lock()


def tokenizer_info(tokenizer: Any, key: tuple) -> Any:
    """xgrammar's TokenizerInfo for `tokenizer`, built once per process per key."""
    with _INFOS_LOCK:
        info = _INFOS.get(key)
        if info is None:
            from peregrine.tokenizer import transformers_tokenizer
            xgr = import_xgrammar()
            _, vocab_size, stop_ids = key
            # NOTE: xgrammar reads a transformers tokenizer (its class decides the vocab's encoding).
            info = xgr.TokenizerInfo.from_huggingface(
                transformers_tokenizer(tokenizer), vocab_size=vocab_size,
                stop_token_ids=list(stop_ids) or None)
            _INFOS[key] = info
        return info


def _rebuild(grammar_json: str, kind: str, key: tuple) -> CompiledStructure:
    info = _INFOS.get(key)
    if info is None:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(key[0], trust_remote_code=False, local_files_only=True)
        info = tokenizer_info(tok, key)
    grammar = import_xgrammar().CompiledGrammar.deserialize_json(grammar_json, info)
    return CompiledStructure(grammar, kind, key)


class StructureCompiler:
    """Compiles StructuredOutputsParams for one tokenizer; an LRU cache keyed by canonical text."""

    def __init__(self, tokenizer: Any, tokenizer_path: str, vocab_size: int,
                 stop_token_ids: Sequence[int]) -> None:
        xgr = import_xgrammar()
        self.key = (str(tokenizer_path), int(vocab_size), tuple(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, self.key), cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], CompiledStructure] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and stats

    def compile(self, so: StructuredOutputsParams) -> CompiledStructure:
        """The compiled grammar of `so`; ValueError naming the field if it does not compile."""
        key = so.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        kind, text = key
        try:
            if kind == "json":
                grammar = self._compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":
                grammar = self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                grammar = self._compiler.compile_regex(text)
            elif kind == "choice":
                grammar = self._compiler.compile_grammar(choice_grammar(so.choice))
            else:
                grammar = self._compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind} does not compile: {_clean(e)}") from None
        compiled = CompiledStructure(grammar, kind, self.key)
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled
