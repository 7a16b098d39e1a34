"""The row-tile persistent decode kernel's layouts and tables (kernels/decode_rows.py): each
16-channel tile's chunks of 8 groups, read in the order its lanes read them, give x @ dequant(W);
the qkv and gate/up channel orders pair what each tile's finish needs; the phases' tiles are
shared out evenly; the phase table chains the phases' counters and sums. (The kernel itself is
Gluon and runs on the GPU only: tests/gpu.)"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from peregrine.kernels.decode_layers import ATTN, DOWN, GU, O, QKV, Dims, LayerWeights  # noqa: E402
from peregrine.kernels.decode_rows import (PLACEMENTS, DecodeRows, balance,  # noqa: E402
                                           emulate, gate_up_rows, pack, qkv_order,
                                           qkv_tile, unsupported)
from peregrine.layers.quantization.wna16 import WNA16Layout  # noqa: E402


def _weights(k: int, n: int, seed: int) -> WNA16Layout:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), dtype=torch.int32, generator=g)
    scales = torch.rand(k // 128, n, generator=g) * 0.01 + 0.002
    zeros = torch.randint(0, 16, (k // 128, n), generator=g).float()
    return WNA16Layout.build(q, scales, zeros, None, 4, torch.bfloat16)


@pytest.mark.parametrize("k,n", [(1024, 16), (2048, 48), (3072, 32)])
def test_the_packed_chunks_read_as_the_lanes_read_them_give_the_product(k: int, n: int) -> None:
    w = _weights(k, n, k + n)
    rows = pack(w.qweight, w.scales, w.zeros)
    assert rows.shape == (n // 16 * (k // 1024) * 17, 128)
    x = torch.randn(k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = (x.float()[None] @ w.dequantize(torch.float32).t())[0]
    torch.testing.assert_close(emulate(rows, x, n), want, rtol=1e-5, atol=1e-4)


def test_the_pairs_a_word_decodes_to_are_adjacent_inputs() -> None:
    """The kernel takes nibbles p and p + 4 of a word (bits 4p and 16 + 4p, one shift and one
    lop3) as one 16-bit pair for the MMA, whose B register holds x's word p: inputs 2p, 2p + 1.
    Lane (g, t)'s first word of a chunk is word row t of channel 2g."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (1024, 16), dtype=torch.int32, generator=g)
    w = WNA16Layout.build(q, torch.ones(8, 16), torch.zeros(8, 16), None, 4, torch.bfloat16)
    rows = pack(w.qweight, w.scales, w.zeros)
    for gg, t in ((0, 0), (3, 2), (7, 3)):
        word = int(rows[0, 2 * (4 * gg + t)]) & 0xFFFFFFFF
        for p in range(4):
            pair = ((word >> (4 * p)) & 0xF, (word >> (16 + 4 * p)) & 0xF)
            assert pair == (int(q[8 * t + 2 * p, 2 * gg]), int(q[8 * t + 2 * p + 1, 2 * gg]))


def test_a_misplaced_word_or_scale_shows() -> None:
    w = _weights(1024, 16, 3)
    rows = pack(w.qweight, w.scales, w.zeros)
    x = torch.randn(1024, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = emulate(rows, x, 16)
    for r, c0, c1 in ((0, 0, 1), (3, 5, 37), (16, 0, 8)):  # two words, then two scale words
        bad = rows.clone()
        bad[r, c0], bad[r, c1] = rows[r, c1], rows[r, c0]
        assert (emulate(bad, x, 16) - want).abs().max() > 1e-3


def test_qkv_tiles_pair_each_channel_with_its_rope_partner_kv_head_by_kv_head() -> None:
    heads, kv, d = 8, 2, 128
    order = qkv_order(heads, kv, d).view(-1, 16)  # (tile in the programs' order, row)
    assert torch.equal(order.flatten().sort().values, torch.arange((heads + 2 * kv) * d))
    t = torch.arange(order.shape[0])
    real = qkv_tile(t, heads, kv, d // 16)
    assert torch.equal(real.sort().values, t)
    # the programs' first 48 tiles: KV head 0's four query heads, then its K, then its V
    heads_of = order[:, 0] // d
    assert heads_of[:48].unique().tolist() == [0, 1, 2, 3, heads, heads + kv]
    for i in range(order.shape[0]):  # the kernel's finish takes tile real[i]'s channels
        rows, head, a = order[i], int(real[i]) // 8, int(real[i]) % 8
        assert bool((rows // d == head).all())
        e = rows % d
        if head < heads + kv:  # rows 2g, 2g + 1: channel 8a + g and its partner, + 64
            assert torch.equal(e[0::2], 8 * a + torch.arange(8))
            assert torch.equal(e[1::2], e[0::2] + d // 2)
        else:  # v: as it is
            assert torch.equal(e, 16 * a + torch.arange(16))


def test_gate_up_tiles_pair_each_gate_channel_with_its_up_channel() -> None:
    rows = gate_up_rows(64).view(-1, 16)
    assert torch.equal(rows[:, 0::2] + 64, rows[:, 1::2])
    assert torch.equal(rows[:, 0::2].flatten(), torch.arange(64))


def test_a_layers_tiles_are_shared_out_evenly() -> None:
    """Each phase's tiles past its whole rounds go to the least loaded programs: no program
    gets more than a tile of each phase above another, and the attention programs are ones
    whose qkv share is the smaller."""
    phases = [(384, 4), (128, -1), (256, 4), (1792, 4), (256, 14)]
    programs = 264
    firsts = balance(phases, programs)
    load = torch.zeros(programs)
    per_phase = []
    for (tiles, chunks), first in zip(phases, firsts):
        got = torch.zeros(programs)
        for t in range(tiles):
            got[(t + first) % programs] += 4 if chunks < 0 else chunks
        per_phase.append(got)
        load += got
    qkv, attn = per_phase[0], per_phase[1]
    assert qkv.max() - qkv.min() == 4
    assert bool((qkv[attn > 0] == 4).all())  # attention on programs with one qkv tile
    assert load.max() < 1.1 * load.mean()


def _weights(k: int, n: int, seed: int) -> WNA16Layout:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), dtype=torch.int32, generator=g)
    return WNA16Layout.build(q, torch.rand(k // 128, n, generator=g) * 0.01 + 0.002,
                             torch.randint(0, 16, (k // 128, n), generator=g).float(), None, 4,
                             torch.bfloat16)


def _small(layers: int = 2, hidden: int = 1024, inter: int = 2048, heads: int = 8,
           kv_heads: int = 2) -> tuple:
    dims = Dims(hidden, heads, kv_heads, 128, inter, 16, 1e-6)
    qd = heads * 128
    shapes = ((hidden, qd + 2 * 128 * kv_heads), (qd, hidden), (hidden, 2 * inter),
              (inter, hidden))
    ws = [LayerWeights(*(_weights(k, n, 10 * i + j) for j, (k, n) in enumerate(shapes)),
                       torch.ones(hidden, dtype=torch.bfloat16),
                       torch.ones(hidden, dtype=torch.bfloat16)) for i in range(layers)]
    return dims, ws


def test_the_phase_table_chains_counters_sums_and_inputs() -> None:
    dims, ws = _small()
    dl = DecodeRows(dims, ws, torch.ones(1024, dtype=torch.bfloat16), torch.device("cpu"),
                    splits=4, programs=8)
    tab = dl.table.tolist()
    assert [r[0] for r in tab] == [QKV, ATTN, O, GU, DOWN] * 2
    qd = dims.heads * dims.head_dim
    cnt = 0
    for f, r in enumerate(tab):
        # each phase's counters follow the one before's, from a multiple of 4 (the poll's
        # 16-byte loads)
        assert r[5] == cnt and cnt % 4 == 0
        groups = {QKV: 12, ATTN: 8, O: 8, GU: 16, DOWN: 8}[r[0]]
        cnt += groups
        if f:
            before = tab[f - 1]
            want = {QKV: 8, ATTN: 12, O: 8, GU: 8, DOWN: 16}[r[0]]
            assert (r[6], r[7]) == (want, before[5])  # the groups it waits for
        else:
            assert r[6] == 0  # (the prologue's input: no wait)
        if r[0] != ATTN:  # where the input's sums a row of 8 are (xn, attention, activation)
            assert r[15] == {QKV: 0, O: dims.hidden // 8, GU: 0,
                             DOWN: (dims.hidden + qd) // 8}[r[0]]
    assert cnt + 256 == dl.cnt.numel()  # (a poll past the last phase's reads padding)
    # 1 / rms from the sums the o / down phase before wrote (the prologue's for the first)
    assert tab[0][8] == 0 and tab[3][8] == tab[2][9] and tab[5][8] == tab[4][9]
    assert len({r[9] for r in tab if r[0] in (O, DOWN)}) == 4  # each its own
    assert dl.weight_bytes == dl.rows.numel() * 4
    # the packed rows of layer 1's o, read as the lanes read them, are its product
    o = ws[1].o
    base = tab[7][1]
    rows = dl.rows[17 * base:17 * (base + tab[7][2] * tab[7][3])]
    x = torch.randn(1024).to(torch.bfloat16)
    torch.testing.assert_close(emulate(rows, x, 1024),
                               (x.float()[None] @ o.dequantize(torch.float32).t())[0],
                               rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="1 layers' caches for 2 layers"):
        dl.bind_caches([(torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16),) * 2])


def test_shapes_it_cannot_run_are_refused_with_the_reason() -> None:
    dims, ws = _small(1, hidden=1024, inter=1536)
    assert "intermediate size 1536" in unsupported(dims, ws, torch.bfloat16)
    # four query heads of 128 over one KV head: o's 512 inputs are not whole chunks
    dims, ws = _small(1, heads=4, kv_heads=1)
    assert "attention width 512" in unsupported(dims, ws, torch.bfloat16)
    dims, ws = _small(1)
    assert unsupported(dims, ws, torch.bfloat16) is None
    with pytest.raises(ValueError, match="fewer than the attention's"):
        DecodeRows(dims, ws, torch.ones(1024, dtype=torch.bfloat16), torch.device("cpu"),
                   splits=4, programs=4)
    # attention's MMAs take a block of K/V rows 8 tokens a warp
    with pytest.raises(ValueError, match="tb 16 is not a positive multiple of 32"):
        DecodeRows(dims, ws, torch.ones(1024, dtype=torch.bfloat16), torch.device("cpu"),
                   splits=4, programs=8, tb=16)


def test_caches_that_do_not_start_at_16_bytes_are_refused() -> None:
    """Attention copies K/V rows 16 bytes at a time: a layer's cache that starts elsewhere is
    refused when the caches are bound, and aligned ones are taken."""
    dims, ws = _small()
    dl = DecodeRows(dims, ws, torch.ones(1024, dtype=torch.bfloat16), torch.device("cpu"),
                    splits=4, programs=8)
    arena = torch.zeros(2 * 4 * 16 * 2 * 128 + 8, dtype=torch.bfloat16)
    one = 4 * 16 * 2 * 128
    cache = [arena[i * one:(i + 1) * one].view(4, 16, 2, 128) for i in range(2)]
    dl.bind_caches([(cache[0], cache[0]), (cache[1], cache[1])])
    assert dl.table[5, 11].item() == one  # layer 1's offset from layer 0's, in elements
    shifted = arena[4:4 + one].view(4, 16, 2, 128)  # 8 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        dl.bind_caches([(cache[0], cache[0]), (shifted, shifted)])


@pytest.mark.parametrize("faster", PLACEMENTS)
def test_the_fastest_form_is_kept(faster: tuple) -> None:
    """choose_placement times every form (programs an SM, ring stages, inputs as B pairs) and
    leaves the kernel in the fastest; a form refused before its launch counts as never
    faster."""
    dims, ws = _small()
    dl = DecodeRows(dims, ws, torch.ones(1024, dtype=torch.bfloat16), torch.device("cpu"),
                    splits=4, programs=8)
    seen = []

    def form() -> tuple:
        return (dl.programs // dl.sms, dl.stages, dl.pre)

    def timer(run, iters):
        seen.append(form())
        return 1.0 if form() == faster else 2.0

    times = dl.choose_placement(lambda: None, timer=timer)
    assert seen == list(PLACEMENTS) and set(times) == set(PLACEMENTS)
    assert form() == faster
    assert dl.table[:5, 14].tolist() == balance(
        [(int(r[2]), int(r[3])) if r[0] != ATTN else (dims.kv_heads * 4, -1)
         for r in dl.table[:5].tolist()], dl.programs)

    def refused(run, iters):
        if dl.programs > dl.sms:
            raise ValueError("decode_rows: not resident at once")
        return 5.0

    times = dl.choose_placement(lambda: None, timer=refused)
    assert form()[0] == 1 and all(times[f] == float("inf") for f in PLACEMENTS if f[0] > 1)
