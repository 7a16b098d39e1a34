"""benchmarks/async_probe.py runs both modes on the CPU (small numbers) and reports every run."""
from __future__ import annotations

import json

import pytest

from benchmark_scripts import load

async_probe = load("async_probe")


@pytest.mark.slow
def test_probe_alternates_the_modes_and_reports_each_run(tmp_path):
    out = tmp_path / "probe.json"
    result = async_probe.main(["--num-prompts", "4", "--max-tokens", "5", "--warmup-tokens", "2",
                               "--repeats", "2", "--dtype", "float32", "--max-model-len", "64",
                               "--out", str(out)])
    assert json.loads(out.read_text())["summary"] == result["summary"]
    for mode, steps in (("async", 6), ("sync", 5)):  # async: one more step collects the last
        runs = result["runs"][mode]
        assert len(runs) == 2
        for run in runs:
            assert run["tokens"] == 4 * 5 and run["steps"] == steps and run["tok_s"] > 0
            assert set(run["host_ms_per_step"]) == {"engine", "core", "runner"}
            assert run["host_ms_per_step"]["engine"]["step_total"] > 0
            assert run["triton_compiles"] in (0, None) and len(run["gc_collections"]) == 3
    assert result["summary"]["async_over_sync"] == pytest.approx(
        result["summary"]["async"]["tok_s_median"] / result["summary"]["sync"]["tok_s_median"])


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        async_probe.parse_args(["--repeats", "0"])
