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


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(bench, "DEV", torch.device("cpu"))
    monkeypatch.setattr(bench, "SHAPES", {"tiny": (2, 20, 40, 4, 2)})
    monkeypatch.setattr(bench, "HEAD_DIM", 16)
    monkeypatch.setattr(bench, "BASE", {v: (16, 4, 1) for v in bench.VARIANTS})
    # NOTE: a deterministic fake time per config (variant, prefetch, clamping): "best" is known.
    costs = {(v, pf, ct): 1.0 + i + 0.5 * pf + 0.25 * ct
             for i, v in enumerate(reversed(bench.VARIANTS)) for pf, ct in bench.PHASE1}
    current = {}
    real_launch = bench.launch

    def launch(p, cfg, out):
        current["cfg"] = cfg
        real_launch(p, cfg, out)

    monkeypatch.setattr(bench, "launch", launch)
    monkeypatch.setattr(bench, "bench_ms", lambda fn: costs[current["cfg"].variant,
                                                             current["cfg"].prefetch,
                                                             current["cfg"].clamp_tokens])


def _args(tmp_path, caches: str) -> argparse.Namespace:
    return argparse.Namespace(out=str(tmp_path / "r.json"), budget_s=0.0, shapes=["tiny"],
                              caches=caches.split(","), ncu=False, from_json=None)


def test_phase_one_runs_every_variant_correctly_and_keeps_the_fastest(tiny, tmp_path) -> None:
    result = bench.run_sweep(_args(tmp_path, "fp8"), t0=0.0)
    rows = result["results"]
    seen = {(r["variant"], r["prefetch"], r["clamp_tokens"]) for r in rows}
    assert seen == {(v, pf, ct) for v in bench.VARIANTS for pf, ct in bench.PHASE1}
    assert all(r["ok"] and r["max_err"] < 1.6e-2 for r in rows), rows  # 2 bf16 ulps
    best = result["best"]["tiny/fp8"]
    assert (best["variant"], best["prefetch"], best["clamp_tokens"]) == (bench.VARIANTS[-1],
                                                                         False, False)
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


def test_neighbours_move_one_knob() -> None:
    cfg = bench.Cfg("fma", 32, 4, 2, True, 4, False)
    for n in bench.neighbours(cfg):
        assert sum(a != b for a, b in zip(n, cfg)) == 1 and n.variant == "fma"
