"""benchmarks/step_trace.py runs W1's workload on the CPU (small numbers) and accounts for every step."""
from __future__ import annotations

import json

import pytest

from benchmark_scripts import load
from peregrine.testing.checkpoints import tiny_checkpoint

step_trace = load("step_trace")


@pytest.mark.slow
def test_trace_records_every_launched_step_and_groups_them(tmp_path):
    out = tmp_path / "trace.json"
    result = step_trace.main(["--model", str(tiny_checkpoint("qwen3")), "--num-prompts", "5",
                              "--min-input", "4", "--max-input", "12", "--min-output", "3",
                              "--max-output", "6", "--dtype", "float32", "--out", str(out)])
    assert json.loads(out.read_text())["summary"] == result["summary"]
    launched = [s for s in result["steps"] if s["launch"] is not None]
    assert launched and [s["launch"] for s in launched] == list(range(len(launched)))
    assert result["output_tokens"] >= 5 * 3
    for s in launched:
        assert s["seqs"] >= 1 and s["tokens"] >= s["seqs"] and s["device_ms"] >= 0
        assert s["decode_only"] == (s["tokens"] == s["seqs"])
    assert sum(g["steps"] for g in result["summary"].values()) == len(launched)
    assert any(name.startswith("mixed") for name in result["summary"])
    assert any(name.startswith("decode") for name in result["summary"])


def test_batch_buckets_cover_every_size():
    assert [step_trace._bucket(n) for n in (1, 2, 8, 9, 256, 257, 5000)] == [
        "1-1", "2-8", "2-8", "9-16", "193-256", ">256", ">256"]
