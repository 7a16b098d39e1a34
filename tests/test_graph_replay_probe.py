"""The batch-1 probes (benchmarks/graph_replay_probe.py, step_gap_probe.py) on the CPU: each
imports, wants `OUT -- engine flags`, and says plainly that it needs a GPU (its timings only mean
something there)."""
from __future__ import annotations

import pytest
import torch

from benchmark_scripts import load


@pytest.mark.parametrize("name", ["graph_replay_probe", "step_gap_probe"])
def test_the_probe_checks_its_arguments_and_its_device(monkeypatch, name: str) -> None:
    probe = load(name)
    with pytest.raises(SystemExit, match="OUT.json"):
        probe.main(["out.json", "--model", "x.json"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        probe.main(["out.json", "--", "--model", "benchmarks/configs/llama-3-8b.json"])
