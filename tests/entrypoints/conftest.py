"""Make the helpers next to these tests (fake_engine, server_utils) importable."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
