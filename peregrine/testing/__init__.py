"""Test helpers: a locally trained BPE tokenizer and tiny deterministic HF-format checkpoints."""
from __future__ import annotations

from peregrine.testing.checkpoints import ARCHS, build_tiny_checkpoint, tiny_checkpoint
from peregrine.testing.tokenizer import build_bpe_tokenizer

__all__ = ["ARCHS", "build_bpe_tokenizer", "build_tiny_checkpoint", "tiny_checkpoint"]
