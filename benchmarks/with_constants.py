"""Run a `peregrine` command in this process with some module constants changed: a way to
measure a launch rule's alternatives end to end before changing the rule itself.

    python benchmarks/with_constants.py peregrine.kernels.decode_attention._MIN_SPLIT_LEN=64 \\
        -- bench latency --model benchmarks/configs/llama-3-8b.json

Each MODULE.NAME=VALUE imports MODULE, checks that NAME exists there, and sets it to VALUE read
as a Python literal. Only in-process commands see the change (the offline benchmarks run the
engine in this process).
"""
from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def apply(assignment: str) -> None:
    target, sep, literal = assignment.partition("=")
    module_name, dot, attr = target.rpartition(".")
    if not (sep and dot and attr):
        raise SystemExit(f"expected MODULE.NAME=VALUE, got {assignment!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise SystemExit(f"{module_name} has no {attr}")
    value = ast.literal_eval(literal)
    print(f"{module_name}.{attr}: {getattr(module, attr)!r} -> {value!r}", file=sys.stderr)
    setattr(module, attr, value)


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    for assignment in argv[:cut]:
        apply(assignment)
    command = argv[cut + 1:]
    from peregrine.entrypoints.cli import main as cli_main
    return cli_main(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
