"""The ring-stream probe's host side (its Gluon kernel runs on the GPU only): the phase tables
each form walks, the folded layer forms, and the timeline it reads from the kernel's timestamps."""
from __future__ import annotations

import torch
from benchmark_scripts import load

probe = load("ring_stream_probe")
barrier = load("layer_barrier_probe")

P, ROWS = 132, 128


def test_every_gemv_phase_is_covered_by_whole_chunks_an_sm() -> None:
    phases = barrier.layer_phases(4) * 2
    table, sched, rows = probe._tables(phases, P, ROWS, short=True, stream=True)
    assert len(table) == len(phases)
    chunk_words = ROWS * probe.COLS.value
    base = 0
    for (name, kind, words, _), row in zip([p for p in phases if p[1] == barrier.STREAM], sched):
        first, nch = row
        assert first == base  # the phases' chunks follow one another, program by program
        assert P * nch * chunk_words >= words > P * (nch - 1) * chunk_words, name
        base += P * nch * ROWS
    assert rows == base
    # each phase waits for as many programs as the phase before it ran
    for prev, cur in zip(table, table[1:]):
        assert cur[3] == prev[2]
    assert table[0][3] == 0


def test_forms_without_stream_or_short_phases() -> None:
    phases = barrier.layer_phases(4)
    no_stream, sched, _ = probe._tables(phases, P, ROWS, short=True, stream=False)
    assert [r[1] for r in no_stream if r[0] == barrier.STREAM] == [0, 0, 0, 0]
    assert [r[1] for r in sched] == [0, 0, 0, 0]
    gemv_only, _, _ = probe._tables(phases, P, ROWS, short=False, stream=True)
    assert [r[0] for r in gemv_only] == [barrier.STREAM] * 4
    assert [r[3] for r in gemv_only] == [0, P, P, P]


def test_folded_layers_keep_the_gemvs_and_attention() -> None:
    engine = probe.layer_kind("engine", 4)
    fused = probe.layer_kind("fused", 4)
    wide = probe.layer_kind("fused_wide", 4)
    assert [p[0] for p in fused] == ["qkv", "attn_split", "o", "gate_up", "down"]
    split = next(p for p in engine if p[0] == "attn_split")
    wide_split = next(p for p in wide if p[0] == "attn_split")
    assert wide_split[3] == 128 and wide_split[2] * 128 == split[2] * split[3]  # same bytes
    assert [p for p in wide if p[1] == barrier.STREAM] == [p for p in engine
                                                           if p[1] == barrier.STREAM]


def test_timeline_means_over_the_middle_layers() -> None:
    layers = 8
    phases = probe.layer_kind("fused", 4) * layers
    table, sched, _ = probe._tables(phases, P, ROWS, short=True, stream=True)
    per, nst = len(table) // layers, len(sched) // layers
    ct = torch.zeros(len(table), P, 2, dtype=torch.int64)
    pt = torch.zeros(len(sched), P, 2, dtype=torch.int64)
    for f, row in enumerate(table):
        layer, j = divmod(f, per)
        start = layer * 50_000 + j * 5_000  # ns
        n = row[2]
        ct[f, :n, 0] = start + torch.arange(n) * 10  # each program's wait ends 10 ns after the one before
        ct[f, :n, 1] = start + 2_000 + torch.arange(n) * 10
    for g in range(len(sched)):
        layer, j = divmod(g, nst)
        pt[g, :, 0] = layer * 50_000 + j * 7_000 - 3_000
        pt[g, :, 1] = layer * 50_000 + j * 7_000 + 1_000
    out = probe._timeline(ct, pt, table, sched, layers)
    assert len(out["phases"]) == per and len(out["producer"]) == nst
    for j, ph in enumerate(out["phases"]):
        n = table[j][2]
        assert ph["met_first"] == j * 5.0
        assert abs(ph["met_last"] - (j * 5.0 + (n - 1) * 0.01)) < 1e-9
        assert abs(ph["end_last"] - (j * 5.0 + 2.0 + (n - 1) * 0.01)) < 1e-9
    assert [p["first_chunk"] for p in out["producer"]] == [j * 7.0 - 3.0 for j in range(nst)]
    assert [p["last_chunk"] for p in out["producer"]] == [j * 7.0 + 1.0 for j in range(nst)]


def test_every_form_is_listed_once_with_its_switches() -> None:
    assert set(probe.FORMS) >= {"ring", "ring_free", "chain_tma", "deps_only", "ring_traced"}
    for name, switches in probe.FORMS.items():
        assert len(switches) == 6 and all(isinstance(s, bool) for s in switches), name
    assert probe.FORMS["chain_tma"][5] and not probe.FORMS["ring"][5]
