"""Session-wide test setup."""
from __future__ import annotations

import os
import tempfile

# NOTE: the demo model is built on first use; keep test builds out of the user's ~/.cache.
os.environ.setdefault("PEREGRINE_CACHE_DIR", tempfile.mkdtemp(prefix="peregrine-test-cache-"))
