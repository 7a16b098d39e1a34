"""The int4 ring probe's host side (its Gluon kernel runs on the GPU only): the tiled weight
layout each TMA chunk reads, the even shares of a phase's units, and the phase table that
places every projection's words, scales, input and output."""
from __future__ import annotations

import torch
from benchmark_scripts import load

probe = load("ring_int4_probe")


def test_a_unit_is_its_group_and_tile_of_the_words() -> None:
    k8, n, tile = 64, 96, 32
    q = torch.randint(-2**31, 2**31 - 1, (k8, n), dtype=torch.int32)
    tiled = probe.tile_words(q, tile)
    groups = k8 // 16
    assert tiled.shape == (groups * (n // tile) * 16, tile)
    for i in range(n // tile):
        for j in range(groups):
            u = i * groups + j
            want = q[16 * j:16 * j + 16, tile * i:tile * (i + 1)]
            assert torch.equal(tiled[16 * u:16 * u + 16], want)


def test_shares_cover_every_unit_once_with_few_pieces_a_tile() -> None:
    for tiles, groups, programs in ((48, 32, 132), (32, 112, 132), (224, 32, 132), (3, 4, 132)):
        w = probe.share(tiles, groups, programs)
        assert w >= 2
        total = tiles * groups
        seen = torch.zeros(total, dtype=torch.int32)
        for pid in range(programs):
            start = min(pid * w, total)
            seen[start:min(start + w, total)] += 1
        assert torch.equal(seen, torch.ones(total, dtype=torch.int32))
        assert -(-total // w) <= programs  # no program is left more than its share
        for tile in range(tiles):  # the pieces of a tile, as the kernel counts them
            first = tile * groups // w
            pieces = ((tile + 1) * groups - 1) // w - first + 1
            assert pieces <= -(-groups // w) + 1


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


def _walk(tiles: int, groups: int, w: int, programs: int) -> list[tuple[int, int, int, int, int]]:
    """The consumers' pieces as the kernels walk them (the same integer arithmetic): (tile, piece
    index, first group, end group, the tile's pieces) for every program's share."""
    total = tiles * groups
    out = []
    for pid in range(programs):
        start = min(pid * w, total)
        end = min(start + w, total)
        u = start
        while u < end:
            tile, g0 = divmod(u, groups)
            g1 = min(groups, g0 + (end - u))
            first = tile * groups // w
            n_pieces = ((tile + 1) * groups - 1) // w - first + 1
            out.append((tile, pid - first, g0, g1, n_pieces))
            u += g1 - g0
    return out


def test_each_tile_is_cut_into_the_pieces_its_ticket_counts() -> None:
    """Every tile's groups are covered once by pieces 0 .. n - 1, where n is the count each piece
    computes (so exactly one piece draws the last ticket and finishes the tile), and the
    partials buffer holds every piece index."""
    for tiles, groups in ((48, 32), (32, 32), (224, 32), (32, 112), (24, 32), (112, 32), (4, 8)):
        w = probe.share(tiles, groups, 132)
        pieces = _walk(tiles, groups, w, 132)
        bound = -(-groups // w) + 1  # the partials rows the probes allocate
        for tile in range(tiles):
            mine = sorted((p, g0, g1, n) for t, p, g0, g1, n in pieces if t == tile)
            assert [p for p, *_ in mine] == list(range(len(mine)))
            assert {n for *_, n in mine} == {len(mine)}
            assert len(mine) <= bound
            assert mine[0][1] == 0 and mine[-1][2] == groups
            assert all(a[2] == b[1] for a, b in zip(mine, mine[1:]))
