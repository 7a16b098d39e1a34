"""The ring-fed int4 GEMV piece's host side (kernels/ring_gemv.py; its Gluon code runs on the
GPU only): the chunk layout of the words and of their scales and zero points, the even shares
of a projection's units, and the pieces a tile is cut into, walked as the kernel walks them."""
from __future__ import annotations

import torch

from peregrine.kernels import ring_gemv as kd


def test_a_unit_is_its_group_and_tile_of_the_words() -> None:
    k8, n, tile = 64, 192, 64
    q = torch.randint(-2**31, 2**31 - 1, (k8, n), dtype=torch.int32)
    tiled = kd.tile_words(q, tile)
    groups = k8 // 16
    assert tiled.shape == (groups * (n // tile) * 16, tile)
    rows = kd.unit_rows(tiled, tile)
    for i in range(n // tile):
        for j in range(groups):
            u = i * groups + j
            want = q[16 * j:16 * j + 16, tile * i:tile * (i + 1)]
            assert torch.equal(rows[u], want)
            flat = tiled[16 * u:16 * u + 16].reshape(-1)
            # a lane's 16 bytes: step s, warp w, quad g, word row 4s + t, the quad's 4 words
            for s, w, g, t in ((0, 0, 0, 0), (1, 0, 2, 3), (3, tile // 32 - 1, 7, 1)):
                at = 4 * tile * s + 128 * w + 16 * g + 4 * t
                assert torch.equal(flat[at:at + 4], want[4 * s + t, 32 * w + 4 * g:][:4])


def test_a_units_scales_row_holds_each_channel_quads_scales_then_zero_points() -> None:
    k, n, tile = 256, 96, 32
    scales = (torch.rand(k // 128, n) + 0.5).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (k // 128, n)).to(torch.bfloat16)
    rows = kd.tile_scales(scales, zeros, tile)
    groups = k // 128
    assert rows.shape == (groups * n // tile, tile)
    s16 = (scales.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
    z16 = (zeros.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
    for u in range(rows.shape[0]):
        i, j = divmod(u, groups)  # tile-major, as tile_words
        for quad in range(tile // 4):
            c = tile * i + 4 * quad
            got = (rows[u, 4 * quad:4 * quad + 4].to(torch.int64) & 0xFFFFFFFF).tolist()
            want = [s16[j][c] | s16[j][c + 1] << 16, s16[j][c + 2] | s16[j][c + 3] << 16,
                    z16[j][c] | z16[j][c + 1] << 16, z16[j][c + 2] | z16[j][c + 3] << 16]
            assert got == want, (u, quad)


def test_shares_cover_every_unit_once_with_few_pieces_a_tile() -> None:
    for tiles, groups, programs in ((48, 32, 132), (32, 112, 132), (224, 32, 132), (3, 4, 132)):
        w = kd.share(tiles, groups, programs)
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
        w = kd.share(tiles, groups, 132)
        pieces = _walk(tiles, groups, w, 132)
        bound = -(-groups // w) + 1  # the partials rows the probes allocate
        for tile in range(tiles):
            mine = sorted((p, g0, g1, n) for t, p, g0, g1, n in pieces if t == tile)
            assert [p for p, *_ in mine] == list(range(len(mine)))
            assert {n for *_, n in mine} == {len(mine)}
            assert len(mine) <= bound
            assert mine[0][1] == 0 and mine[-1][2] == groups
            assert all(a[2] == b[1] for a, b in zip(mine, mine[1:]))


def test_the_shared_copy_of_x_holds_the_widest_input_in_whole_blocks() -> None:
    """Groups of 128 inputs in x's shared-memory copy: every projection's input fits, a power of
    two (the copy's shape), and whole blocks of a tile's rows (16 a group; one row a thread)."""
    for k_max, tile in ((14336, 128), (14336, 256), (4096, 128), (512, 256), (28672, 128)):
        g = kd.x_groups(k_max, tile)
        assert g * 128 >= k_max and g & (g - 1) == 0
        assert (g * 16) % tile == 0
        assert g // 2 * 128 < k_max or g == tile // 16  # the smallest such
    assert kd.x_groups(14336, 128) * 16 * 16 == 32 * 1024  # Llama-3-8B: 32 KB a program
