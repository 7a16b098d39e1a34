"""The local BPE tokenizer, re-exported for the tests (it lives in peregrine.demo.tokenizer)."""
from __future__ import annotations

from peregrine.demo.tokenizer import (  # noqa: F401
    BOS_TOKEN, CHAT_TEMPLATE, CORPUS, EOS_TOKEN, IM_END, IM_START, PAD_TOKEN, SPECIAL_TOKENS,
    SPLIT_REGEX, _trained_tokenizer_json, build_bpe_tokenizer, token_texts)
