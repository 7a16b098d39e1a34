"""`python -m peregrine ...` runs the `peregrine` command."""
from __future__ import annotations

import sys

from peregrine.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
