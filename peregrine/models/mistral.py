"""Mistral: Llama with GQA and (v0.1) a sliding window on every layer."""
from __future__ import annotations

from typing import Any

from peregrine.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    @classmethod
    def default_windows(cls, hf: dict[str, Any], window: int, n: int) -> list[int | None]:
        """`sliding_window` applies to every layer."""
        return [window] * n
