"""The OpenAI-compatible HTTP server (FastAPI): protocol schemas, completion and chat handlers."""
from __future__ import annotations
