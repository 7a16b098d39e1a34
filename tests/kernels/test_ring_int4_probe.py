"""The int4 ring probe's host side (its Gluon kernel runs on the GPU only): the phase table that
places every projection's words, scales, input and output."""
from __future__ import annotations

import torch
from benchmark_scripts import load

probe = load("ring_int4_probe")


def test_the_phase_table_places_each_projection_after_the_one_before() -> None:
    proj = (("a", 256, 128), ("b", 128, 256))
    d = probe.build(2, 1, 8, torch.device("cpu"), proj)
    table = d["table"].tolist()
    assert len(table) == 4
    row = s = x = o = 0
    for (name, k, n), r in zip(proj * 2, table):
        tiles, groups = n // 32, k // 128
        assert r == [row, probe.share(tiles, groups, 8), tiles * groups, groups, n, s, x, o], name
        row += tiles * groups * 16
        s, x, o = s + groups * n, x + k, o + n
    assert d["words"].shape == (row, 32)
    assert d["scales"].numel() == d["zeros"].numel() == s
    assert d["x"].numel() == x and d["out_n"] == o
    # the tiled words of the second layer's first projection are its layout's
    w = d["layouts"][1][0]
    r = table[2]
    assert torch.equal(d["words"][r[0]:r[0] + 16 * r[2]], probe.tile_words(w.qweight, 32))
    assert torch.equal(d["scales"][r[5]:r[5] + r[3] * r[4]], w.scales.reshape(-1))
