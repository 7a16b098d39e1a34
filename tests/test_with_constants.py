"""benchmarks/with_constants.py: a module constant changed for one in-process CLI run; unknown
names and malformed assignments refused."""
from __future__ import annotations

import pytest

from benchmark_scripts import load


def test_sets_a_module_constant_then_runs_the_cli(monkeypatch, capsys) -> None:
    import peregrine.entrypoints.cli as cli
    import peregrine.kernels.decode_attention as da
    wc = load("with_constants")
    seen = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append((argv, da._MIN_SPLIT_LEN)) or 0)
    monkeypatch.setattr(da, "_MIN_SPLIT_LEN", da._MIN_SPLIT_LEN)  # restored afterwards
    assert wc.main(["peregrine.kernels.decode_attention._MIN_SPLIT_LEN=64", "--",
                    "bench", "latency", "--model", "m.json"]) == 0
    assert seen == [(["bench", "latency", "--model", "m.json"], 64)]
    assert "_MIN_SPLIT_LEN: 256 -> 64" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["peregrine.kernels.decode_attention._NO_SUCH=1", "--", "bench"], "has no _NO_SUCH"),
    (["_MIN_SPLIT_LEN=64", "--", "bench"], "expected MODULE.NAME=VALUE"),
    (["peregrine.kernels.decode_attention._MIN_SPLIT_LEN=64", "bench"], "module constants"),
])
def test_refuses_what_it_cannot_apply(argv: list[str], message: str) -> None:
    wc = load("with_constants")
    with pytest.raises(SystemExit, match=message):
        wc.main(argv)
