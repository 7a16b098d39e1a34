"""benchmarks/pacing_trace.py drives the core's serving loop on the CPU (small numbers) and
accounts for every request's time to first token."""
from __future__ import annotations

import json

import pytest

from benchmark_scripts import load
from peregrine.testing.checkpoints import tiny_checkpoint

pacing_trace = load("pacing_trace")


@pytest.mark.slow
def test_trace_splits_every_requests_first_token_time(tmp_path) -> None:
    out = tmp_path / "trace.json"
    result = pacing_trace.main([
        "--model", str(tiny_checkpoint("llama")), "--dtype", "float32", "--num-prompts", "12",
        "--rate", "40", "--min-input", "10", "--max-input", "20", "--min-output", "4",
        "--max-output", "8", "--vocab", "200", "--max-model-len", "256",
        "--pacers", "off,default,0.3:0", "--keep-steps", "--out", str(out)])
    runs = result["results"]
    assert json.loads(out.read_text()) == runs
    assert [r["setting"] for r in runs] == ["off", "default", "0.3:0"]
    for r in runs:
        assert r["requests"] == 12
        parts = r["per_request_ms"]
        # ttft = wait + lag + device + out, request by request, so the means add up too
        total = sum(parts[k]["mean"] for k in ("wait", "lag", "device", "out"))
        assert total == pytest.approx(parts["ttft"]["mean"], rel=1e-6, abs=1e-6)
        assert parts["wait"]["p10"] >= 0 and parts["device"]["p10"] > 0
        assert r["steps"]["mixed"] >= 1 and r["steps"]["decode"] >= 1
        launched = r["launches"]
        assert len(launched) == r["steps"]["mixed"] + r["steps"]["decode"]
        assert all(x["dev_end"] >= x["dev_start"] for x in launched)


def test_settings_name_the_pacer() -> None:
    assert pacing_trace._pacer("off") is None
    default = pacing_trace._pacer("default")
    custom = pacing_trace._pacer("0.3:0")
    for w in (0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004):
        default.observe(w)
        custom.observe(w)
    assert default.budget() == pytest.approx(0.004 - 0.0004)
    assert custom.budget() == pytest.approx(0.004 - 0.0003)
    with pytest.raises(ValueError):
        pacing_trace._pacer("fast")
