"""benchmarks/decode_attn_bench.py on the CPU: tiny shapes under the Triton interpreter, a fake
timer. Every variant is launched and checked against the reference, a wrong kernel is flagged,
the best config is a correct one, and the JSON holds every row."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_attn_bench.py"
_spec = importlib.util.spec_from_file_location("decode_attn_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["decode_attn_bench"] = bench
_spec.loader.exec_module(bench)


def fake_ms(cfg) -> float:
    """A made-up time per config, so the best one is known."""
    return ({"dot": 3.0, "dot_kt": 2.0, "fma": 1.0}[cfg.variant] + 0.5 * cfg.prefetch
            + 0.25 * cfg.clamp_tokens + 0.125 * (not cfg.aligned) + cfg.block_n / 1000)


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(bench, "DEV", torch.device("cpu"))
    monkeypatch.setattr(bench, "SHAPES", {"tiny": (2, 20, 40, 4, 2)})
    monkeypatch.setattr(bench, "HEAD_DIM", 16)
    current = {}
    real_launch = bench.launch

    def launch(p, cfg, out):
        current["cfg"] = cfg
        real_launch(p, cfg, out)

    monkeypatch.setattr(bench, "launch", launch)
    monkeypatch.setattr(bench, "bench_ms", lambda fn: fake_ms(current["cfg"]))


def _args(tmp_path, caches: str) -> argparse.Namespace:
    return argparse.Namespace(out=str(tmp_path / "r.json"), budget_s=0.0, shapes=["tiny"],
                              caches=caches.split(","), ncu=False, from_json=None)


def test_phase_one_runs_every_start_correctly_and_keeps_the_fastest(tiny, tmp_path) -> None:
    result = bench.run_sweep(_args(tmp_path, "fp8"), t0=0.0)
    rows = result["results"]
    measured = {bench.Cfg(*(r[f] for f in bench.Cfg._fields)) for r in rows}
    default = bench.Cfg(*bench.pick_config(torch.bfloat16, torch.float8_e4m3fn, 2, True))
    former = bench.Cfg(programs_per_sm=default.programs_per_sm, **bench.FORMER)
    starts = {former._replace(**start) for start in bench.PHASE1}
    starts = {c._replace(asm_cvt=False) if c.variant == "fma" else c for c in starts}
    assert measured == {default} | starts
    assert {r["tag"] for r in rows} == {"default", "former", "base"}
    assert {r["variant"] for r in rows} == set(bench.VARIANTS)
    assert all(r["ok"] and r["max_err"] < 1.6e-2 for r in rows), rows  # 2 bf16 ulps
    best = result["best"]["tiny/fp8"]
    assert best["us"] == min(r["us"] for r in rows) and best["variant"] == "fma"
    json.dumps(result)  # plain data only


def test_a_wrong_result_is_never_the_best(tiny, tmp_path, monkeypatch) -> None:
    real = bench.paged_decode_attention

    def broken_fma(*a, **kw):
        out = real(*a, **kw)
        if kw["variant"] == "fma":
            out.add_(1.0)
        return out

    monkeypatch.setattr(bench, "paged_decode_attention", broken_fma)
    result = bench.run_sweep(_args(tmp_path, "bf16"), t0=0.0)
    fma = [r for r in result["results"] if r["variant"] == "fma"]
    assert fma and not any(r["ok"] for r in fma)
    assert result["best"]["tiny/bf16"]["variant"] == "dot_kt"  # the next cheapest
    # the bf16 cache has no FP8 conversion to choose: those starts are timed once
    assert not any(r["asm_cvt"] for r in result["results"])


def test_neighbours_move_one_knob() -> None:
    cfg = bench.Cfg("fma", 32, 4, 2, True, 4, False, True, False, False)
    for n in bench.neighbours(cfg):
        assert sum(a != b for a, b in zip(n, cfg)) == 1 and n.variant == "fma"
