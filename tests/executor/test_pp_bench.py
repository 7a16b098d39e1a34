"""benchmarks/pp_bench.py on the CPU: one process against two pipeline stages of a tiny model,
with tokens/s and each stage's idle fraction in its JSON."""
from __future__ import annotations

import json

import pytest

from benchmark_scripts import load
from peregrine.testing.checkpoints import tiny_checkpoint


@pytest.mark.slow
def test_the_benchmark_reports_throughput_and_stage_idle_fractions(tmp_path) -> None:
    bench = load("pp_bench")
    out = tmp_path / "pp.json"
    bench.main(["--model", str(tiny_checkpoint("llama")), "--device", "cpu", "--dtype",
                "float32", "--setups", "tp1,pp2", "--input-len", "12", "--output-len", "6",
                "--batch1-output-len", "4", "--num-prompts", "6", "--max-num-seqs", "4",
                "--num-gpu-blocks", "64", "--output-json", str(out)])
    got = json.loads(out.read_text())
    assert set(got["setups"]) == {"tp1", "pp2"}
    for name, setup in got["setups"].items():
        for run in ("batch1", "batched"):
            assert setup[run]["output_tokens_per_s"] > 0
    assert got["setups"]["tp1"]["batched"]["stages"] == []
    pp = got["setups"]["pp2"]["batched"]
    assert len(pp["stages"]) == 2 and all(0.0 <= f < 1.0 for f in pp["idle_fraction"])
    assert pp["max_steps_in_flight"] == 2
    assert got["setups"]["pp2"]["batch1"]["max_steps_in_flight"] == 1  # one request: one step
