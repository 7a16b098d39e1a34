"""benchmarks/graph_replay_probe.py on the CPU: it imports, wants `OUT -- engine flags`, and says
plainly that it needs a GPU (its timings only mean something there)."""
from __future__ import annotations

import pytest
import torch

from benchmark_scripts import load


def test_the_probe_checks_its_arguments_and_its_device(monkeypatch) -> None:
    probe = load("graph_replay_probe")
    with pytest.raises(SystemExit, match="OUT.json"):
        probe.main(["out.json", "--model", "x.json"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        probe.main(["out.json", "--", "--model", "benchmarks/configs/llama-3-8b.json"])
