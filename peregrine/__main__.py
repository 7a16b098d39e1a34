"""`python -m peregrine ...` runs the `peregrine` command."""
from __future__ import annotations

from peregrine.entrypoints.cli import run

if __name__ == "__main__":
    run()
