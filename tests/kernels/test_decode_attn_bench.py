"""benchmarks/decode_attn_bench.py on the CPU: tiny shapes under the Triton interpreter, a fake
timer. Every variant is launched and checked against the reference, a wrong kernel is flagged,
the best config is a correct one, and the JSON holds every row."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmark_scripts import load

pytestmark = pytest.mark.slow  # (a benchmark script's checks: about 8 s under the interpreter)

bench = load("decode_attn_bench")


def fake_ms(cfg) -> float:
    """A made-up time per config, so the best one is known."""
    return ({"dot": 3.0, "dot_kt": 2.0, "fma": 1.0, "fma_fp8": 1.5}[cfg.variant]
            + 0.5 * cfg.prefetch
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


def _no_pps(cfgs) -> set:
    return {c._replace(programs_per_sm=0) for c in cfgs}


def _args(tmp_path, caches: str) -> argparse.Namespace:
    return argparse.Namespace(out=str(tmp_path / "r.json"), budget_s=0.0, shapes=["tiny"],
                              caches=caches.split(","), ncu=False, from_json=None, quick=False,
                              probe=False)


def test_phase_one_runs_every_start_correctly_and_keeps_the_fastest(tiny, tmp_path) -> None:
    result = bench.run_sweep(_args(tmp_path, "fp8"), t0=0.0)
    rows = result["results"]
    measured = {bench.Cfg(*(r[f] for f in bench.Cfg._fields)) for r in rows}
    default = bench.Cfg(*bench.pick_config(torch.bfloat16, torch.float8_e4m3fn, 2, True))
    former = bench.Cfg(programs_per_sm=default.programs_per_sm, **bench.FORMER)
    previous = bench.Cfg(**bench.PREVIOUS_FP8_SMALL_GROUP)
    starts = {former._replace(**start) for start in bench.PHASE1}
    starts = {c._replace(asm_cvt=False) if c.variant == "fma" else c for c in starts}
    # the tiny model's 2 kv heads: starts over 4 kv heads a program are not its launches
    assert any(c.kv_heads_per_program == 4 for c in starts)
    starts = {c for c in starts if c.kv_heads_per_program <= 2}
    # NOTE: the tiny table has room for one split only: configs that differ only in programs
    # per SM are the same kernel and are timed once.
    assert _no_pps(measured) == _no_pps({default, previous} | starts)
    # (the previous FP8 choice is timed once, under "default", while the two coincide)
    assert {"default", "former", "base"} <= {r["tag"] for r in rows}
    # (a GPU-only variant is timed on a GPU, where it is the launcher's FP8 default)
    assert {r["variant"] for r in rows} == set(bench.VARIANTS) - set(bench.GPU_ONLY_VARIANTS)
    assert {r["kv_heads_per_program"] for r in rows} == {1, 2}
    # a split per sequence and kv-head row at least
    assert all(r["programs"] >= 2 * 2 // r["kv_heads_per_program"] for r in rows)
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
    # variants that read FP8 caches only are not tried on a bf16 cache
    assert not any(r["variant"] in bench.FP8_ONLY_VARIANTS for r in result["results"])


def test_quick_times_the_default_the_previous_choice_and_the_prefetched_and_multi_head_starts(
        tiny, tmp_path) -> None:
    args = _args(tmp_path, "fp8,bf16")
    args.quick = True
    rows = bench.run_sweep(args, t0=0.0)["results"]
    former = bench.Cfg(programs_per_sm=4, **bench.FORMER)
    starts = {former._replace(**s) for s in bench.PHASE1
              if s.get("prefetch") or s.get("kv_heads_per_program", 1) == 2}
    assert any(c.variant in bench.FP8_ONLY_VARIANTS for c in starts)
    assert any(c.kv_heads_per_program == 2 for c in starts)
    fp8_default = bench.Cfg(*bench.pick_config(torch.bfloat16, torch.float8_e4m3fn, 2, True))
    fp8 = {bench.Cfg(*(r[f] for f in bench.Cfg._fields)) for r in rows if r["cache"] == "fp8"}
    assert _no_pps(fp8) == _no_pps(starts | {fp8_default, bench.Cfg(
        **bench.PREVIOUS_FP8_SMALL_GROUP)})
    bf16_default = bench.Cfg(*bench.pick_config(torch.bfloat16, torch.bfloat16, 2, True))
    bf16 = {bench.Cfg(*(r[f] for f in bench.Cfg._fields)) for r in rows if r["cache"] == "bf16"}
    starts = {c._replace(asm_cvt=False) for c in starts if c.variant not in
              bench.FP8_ONLY_VARIANTS}
    assert _no_pps(bf16) == _no_pps(starts | {bf16_default, bench.Cfg(**bench.PREVIOUS_BF16)})
    assert all(r["ok"] for r in rows)


def test_shapes_pad_the_batch_like_a_decode_graph_over_a_wide_table(monkeypatch) -> None:
    monkeypatch.setattr(bench, "DEV", torch.device("cpu"))
    monkeypatch.setattr(bench, "SHAPES", {"g": (5, 20, 40, 4, 2, 256, True)})
    p = bench.make_problem("g", "fp8", with_reference=False)
    assert p.q.shape[0] == 16 and p.block_table.shape == (16, 16)
    assert (p.seq_lens[5:] == 0).all() and (p.seq_lens[:5] >= 20).all()
    assert p.nbytes == (2 * sum(p.lens) * 2 * bench.HEAD_DIM + 2 * p.q.numel() * 2)


def test_read_probe_reads_exactly_the_cache_bytes_of_each_head_group(monkeypatch) -> None:
    """The probe's XOR of every K/V word each program reads equals the host's, for one and two
    kv heads per program, FP8 and bf16, with a padding sequence; a flipped byte shows."""
    monkeypatch.setattr(bench, "DEV", torch.device("cpu"))
    monkeypatch.setattr(bench, "HEAD_DIM", 16)
    monkeypatch.setattr(bench, "SHAPES", {"g": (3, 20, 40, 4, 2, 64, True)})
    monkeypatch.setattr(bench, "bench_ms", lambda fn: 1.0)
    problems = {("g", c): bench.make_problem("g", c, with_reference=False)
                for c in ("fp8", "bf16")}
    rows = bench.run_probe(problems, check=True)
    assert [(r["cache"], r["heads_per_program"]) for r in rows] == [
        ("fp8", 1), ("fp8", 2), ("bf16", 1), ("bf16", 2)]
    assert all(r["ok"] for r in rows)
    p = problems["g", "fp8"]
    before = bench.probe_expected(p, 1)
    p.v_cache.view(torch.uint8)[int(p.block_table[0, 0]), 0, 1, 3] ^= 0x10  # seq 0, kv head 1
    out = torch.empty(16, 2, dtype=torch.int32)
    bench.read_probe(p, 1, out)
    changed = (out != before).nonzero().tolist()
    assert changed == [[0, 1]] and torch.equal(out, bench.probe_expected(p, 1))


def test_neighbours_move_one_knob() -> None:
    cfg = bench.Cfg("fma", 32, 4, 2, True, 4, False, True, False, False)
    for n in bench.neighbours(cfg):
        assert sum(a != b for a, b in zip(n, cfg)) == 1 and n.variant == "fma"
    assert {n.kv_heads_per_program for n in bench.neighbours(cfg)} == {1, 2, 4}
    dot = cfg._replace(variant="dot", block_n=64)  # several kv heads a program: "fma" only
    assert {n.kv_heads_per_program for n in bench.neighbours(dot)} == {1}
