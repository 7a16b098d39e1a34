"""Llama 2 / 3 / 3.1: the shared decoder as is (qkv and o bias from `attention_bias`)."""
from __future__ import annotations

from peregrine.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Sliding windows only from `layer_types`; RoPE default, linear or llama3-scaled."""
