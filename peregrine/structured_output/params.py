"""StructuredOutputsParams: what the text must match (vLLM's names); exactly one kind is set."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# NOTE: bounds on what a request may ask the grammar compiler to chew on (it runs in the front end).
MAX_SPEC_CHARS = 65536
MAX_CHOICES = 1024

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain generated text to a JSON schema, any JSON object, a regex, one of a list of
    strings, or an EBNF/GBNF grammar."""

    json: dict[str, Any] | str | None = None  # a JSON schema, as a dict or JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # the whole output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF) with a `root` rule

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", list(self.choice))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, msg: str) -> ValueError:
            return ValueError(f"structured_outputs.{name} {msg}")
        if not isinstance(self.json_object, bool):
            raise bad("json_object", f"must be a boolean, got {self.json_object!r}")
        set_kinds = [k for k in _KINDS if (self.json_object if k == "json_object"
                                           else getattr(self, k) is not None)]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got "
                             f"{len(set_kinds)} ({', '.join(set_kinds) or 'none'})")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                if len(schema) > MAX_SPEC_CHARS:
                    raise bad("json", f"must be at most {MAX_SPEC_CHARS} characters")
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise bad("json", f"is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise bad("json", f"must be a JSON schema (an object), got {type(schema).__name__}")
            if len(self.schema_text) > MAX_SPEC_CHARS:
                raise bad("json", f"must be at most {MAX_SPEC_CHARS} characters")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise bad(name, f"must be a non-empty string, got {value!r}")
            if len(value) > MAX_SPEC_CHARS:
                raise bad(name, f"must be at most {MAX_SPEC_CHARS} characters, got {len(value)}")
        if self.choice is not None:
            c = self.choice
            if not isinstance(c, list) or not c or any(not isinstance(s, str) or not s for s in c):
                raise bad("choice", f"must be a non-empty list of non-empty strings, got {c!r}")
            if len(c) > MAX_CHOICES:
                raise bad("choice", f"may hold at most {MAX_CHOICES} strings, got {len(c)}")
            if sum(len(s) for s in c) > MAX_SPEC_CHARS:
                raise bad("choice", f"must total at most {MAX_SPEC_CHARS} characters")

    @property
    def kind(self) -> str:
        """Which field is set: json, json_object, regex, choice or grammar."""
        return next(k for k in _KINDS if (self.json_object if k == "json_object"
                                          else getattr(self, k) is not None))

    @property
    def schema_text(self) -> str:
        """The JSON schema in canonical form (sorted keys, no spaces): the compile cache's key."""
        if self.json is None:
            raise ValueError("structured_outputs.json is not set")
        schema = json.loads(self.json) if isinstance(self.json, str) else self.json
        try:
            return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.json cannot be written as JSON: {e}") from None

    def cache_key(self) -> tuple[str, str]:
        """(kind, canonical text): equal keys compile to the same grammar."""
        kind = self.kind
        if kind == "json":
            return kind, self.schema_text
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(self.choice, ensure_ascii=False)
        return kind, getattr(self, kind)
