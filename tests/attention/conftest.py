from __future__ import annotations

import os

# NOTE: must run before any Triton kernel module is imported: triton.jit reads it at decoration.
os.environ.setdefault("TRITON_INTERPRET", "1")
