"""Session-wide test setup."""
from __future__ import annotations

import os
import tempfile

import torch

# NOTE: the demo model is built on first use; keep test builds out of the user's ~/.cache.
os.environ.setdefault("PEREGRINE_CACHE_DIR", tempfile.mkdtemp(prefix="peregrine-test-cache-"))
# NOTE: kernels run under Triton's interpreter on a machine without a GPU; it must be set before
# any module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
