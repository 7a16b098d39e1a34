"""Attention backends over the paged KV cache, selected by name."""
from __future__ import annotations

from peregrine.attention.backend import BACKEND_NAMES, AttentionBackend, get_attention_backend
from peregrine.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "BACKEND_NAMES", "get_attention_backend"]
