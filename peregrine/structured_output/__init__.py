"""Structured outputs: text constrained by a JSON schema, a regex, a choice or a grammar (xgrammar).

`params.py` is the request field (no xgrammar needed to import it); `compiler.py` compiles grammars
in the front end (cached by canonical text); `manager.py` keeps each request's matcher in the
engine core and builds the step's token bitmask; the sampler applies it (sample/constraints.py).
"""
from __future__ import annotations

from peregrine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
