"""Qwen2: bias on q/k/v (not on o), sliding windows from `use_sliding_window`."""
from __future__ import annotations

from typing import Any

from peregrine.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderParts


class Qwen2Attention(DecoderAttention):
    @staticmethod
    def qkv_bias(hf: dict[str, Any]) -> bool:
        return True

    @staticmethod
    def o_bias(hf: dict[str, Any]) -> bool:
        return False


def qwen_windows(hf: dict[str, Any], window: int, n: int) -> list[int | None]:
    """With use_sliding_window, the layers from max_window_layers on (as transformers reads it)."""
    if not hf.get("use_sliding_window", False):
        return [None] * n
    first = int(hf.get("max_window_layers", n))
    return [window if i >= first else None for i in range(n)]


class Qwen2ForCausalLM(DecoderForCausalLM):
    parts = DecoderParts(attention=Qwen2Attention)

    @classmethod
    def default_windows(cls, hf: dict[str, Any], window: int, n: int) -> list[int | None]:
        return qwen_windows(hf, window, n)
