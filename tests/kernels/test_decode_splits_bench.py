"""benchmarks/decode_splits_bench.py on the CPU: config specs, W1's running sequences per step,
the padded problem, and the former fixed-split rule giving the same attention as the
per-sequence rule (Triton interpreter, tiny head dim)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import benchmarks.decode_splits_bench as bench  # noqa: E402
from peregrine.bench.offline import w1_requests  # noqa: E402


def test_config_specs_change_the_launchers_choice() -> None:
    default = bench.pick_config(torch.bfloat16, torch.bfloat16, 2, True)
    assert bench.parse_config("default", "bf16") == ("per-seq", default)
    assert bench.parse_config("fixed", "bf16") == ("fixed", default)
    rule, cfg = bench.parse_config("fixed+pps=8+heads_first=0+block_n=32", "bf16")
    assert rule == "fixed"
    assert cfg == default._replace(programs_per_sm=8, heads_first=False, block_n=32)
    rule, cfg = bench.parse_config("kvh=2+variant=fma", "fp8")
    assert rule == "per-seq" and cfg.kv_heads_per_program == 2 and cfg.variant == "fma"
    with pytest.raises(AttributeError):
        bench.parse_config("no_such_knob=1", "bf16")


def test_w1_lens_are_the_running_sequences_of_that_step() -> None:
    prompts, outs = w1_requests(256, 0, 100, 1024, 100, 1024)
    lens = bench.w1_lens_at(500)
    assert len(lens) == sum(n > 500 for n in outs) and 0 < len(lens) < 256
    assert sorted(lens) == sorted(len(p) + 500 for p, n in zip(prompts, outs) if n > 500)
    assert len(bench.w1_lens_at(0)) == 256 and bench.w1_lens_at(1024) == []


def test_fixed_and_per_sequence_splits_agree(monkeypatch) -> None:
    monkeypatch.setattr(bench, "DEV", torch.device("cpu"))
    monkeypatch.setattr(bench, "HEAD_DIM", 16)
    monkeypatch.setattr(bench, "HQ", 4)
    monkeypatch.setattr(bench, "HKV", 2)
    p = bench.make_problem([300, 900, 7], "bf16", layers=2)
    assert p["batch"] == 4 and p["lens"].tolist() == [300, 900, 7, 0]  # padded like a graph
    assert p["table"].shape == (4, 128) and len(p["caches"]) == 2
    cfg = bench.pick_config(torch.bfloat16, torch.bfloat16, 2, False)._replace(
        programs_per_sm=8)
    # 4 splits: fixed ones of 512 tokens (900 = 512 + 388), per-sequence ones of 256 (4 of them)
    assert bench.decode_num_splits(4, 2, 128, 16, bench.DEV, 8) == 4
    outs = {}
    for rule in ("fixed", "per-seq"):
        outs[rule] = torch.empty_like(p["q"])
        bench.launch(p, 1, rule, cfg, outs[rule])
    torch.testing.assert_close(outs["fixed"].float(), outs["per-seq"].float(), atol=2e-2,
                               rtol=2e-2)
    assert torch.equal(outs["fixed"][3], torch.zeros_like(outs["fixed"][3]))
