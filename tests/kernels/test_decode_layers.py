"""The persistent decode kernel's host side (kernels/decode_layers.py; its Gluon kernel runs on
the GPU only): the chunk layout of the words and of their scales and zero points, the gate/up
channel order its tiles read, the phase table and the caches' offsets, what it refuses; and the
torch layers its GPU check compares with (benchmarks/decode_layer_ring.py), which without their
roundings are transformers' Llama layers."""
from __future__ import annotations

import inspect

import pytest
import torch
from benchmark_scripts import load

from peregrine.kernels import decode_layers as kd
from peregrine.layers.quantization.wna16 import WNA16Layout

bench = load("decode_layer_ring")
CFG = {"H": 256, "HEADS": 4, "KVH": 1, "D": 128, "INTER": 512, "BS": 16, "theta": 10000.0,
       "eps": 1e-6}
# eight consumer warps: tiles of 256 channels, two heads
CFG8 = dict(CFG, H=512, HEADS=8, KVH=2, INTER=1024)
CPU = torch.device("cpu")


def _build(warps: int, layers: int = 2, ctx: int = 37) -> tuple[dict, dict]:
    cfg = CFG if warps == 4 else CFG8
    return bench.build(layers, 8, ctx, CPU, cfg, warps=warps, splits=4), cfg


def test_a_unit_is_its_group_and_tile_of_the_words() -> None:
    k8, n, tile = 64, 96, 32
    q = torch.randint(-2**31, 2**31 - 1, (k8, n), dtype=torch.int32)
    tiled = kd.tile_words(q, tile)
    groups = k8 // 16
    assert tiled.shape == (groups * (n // tile) * 16, tile)
    for i in range(n // tile):
        for j in range(groups):
            u = i * groups + j
            want = q[16 * j:16 * j + 16, tile * i:tile * (i + 1)]
            assert torch.equal(tiled[16 * u:16 * u + 16], want)


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
@pytest.mark.parametrize("half", (64, 128))
def test_a_gate_up_tile_is_gate_channels_then_the_same_up_channels(half: int) -> None:
    inter = 512
    order = kd.gate_up_order(inter, half)
    assert sorted(order.tolist()) == list(range(2 * inter))
    for j, tile in enumerate(order.view(-1, 2 * half).tolist()):
        assert tile[:half] == list(range(half * j, half * j + half))
        assert tile[half:] == [inter + c for c in range(half * j, half * j + half)]


@pytest.mark.parametrize("warps", (4, 8))
def test_the_packed_weights_are_each_projections_weight(warps: int) -> None:
    """Every phase's words and scale rows, read as the kernel reads them through the table, are
    the layout's dequantized weight bit for bit (gate/up in the kernel's channel order)."""
    d, _ = _build(warps)
    dl = d["dl"]
    f = 0
    for w in d["weights"]:
        for kind, layout in ((kd.QKV, w.qkv), (kd.ATTN, None), (kd.O, w.o),
                             (kd.GU, w.gate_up), (kd.DOWN, w.down)):
            if layout is None:
                with pytest.raises(ValueError, match="no weight"):
                    dl.unpack(f)
            else:
                want = layout.dequantize(torch.float32).t()
                if kind == kd.GU:
                    want = want[:, dl.order]
                assert torch.equal(dl.unpack(f), want), (f, kind)
            f += 1


def test_symmetric_weights_pack_their_implicit_zero_point() -> None:
    d, cfg = _build(4, layers=1)
    w = d["weights"][0]
    q = w.qkv.unpacked()
    sym = WNA16Layout.build(q, w.qkv.scales.float(), None, None, 4, torch.bfloat16)
    dl = kd.DecodeLayers(bench.dims_of(cfg), [w._replace(qkv=sym)], d["norms"][-1], CPU,
                         splits=4, programs=8)
    assert torch.equal(dl.unpack(0), sym.dequantize(torch.float32).t())


@pytest.mark.parametrize("warps", (4, 8))
def test_the_phase_table_walks_each_layer_in_five_phases(warps: int) -> None:
    d, cfg = _build(warps)
    dl = d["dl"]
    table = dl.table.tolist()
    H, INTER, QD, tile = cfg["H"], cfg["INTER"], cfg["HEADS"] * 128, 32 * warps
    qkv = (cfg["HEADS"] + 2 * cfg["KVH"]) * 128
    off = kd.offsets(dl.dims)
    assert [r[0] for r in table] == [kd.QKV, kd.ATTN, kd.O, kd.GU, kd.DOWN] * 2
    row = s = 0
    for f, r in enumerate(table):
        layer = f // 5
        k, v = d["caches"][layer]
        assert r[9] == (k.data_ptr() - d["k_cache"].data_ptr()) // 2  # the layer's own caches
        assert r[10] == (v.data_ptr() - d["v_cache"].data_ptr()) // 2
        if r[0] == kd.ATTN:
            assert r[2:4] == [0, 0]  # no weight units
            continue
        k, n = {kd.QKV: (H, qkv), kd.O: (QD, H), kd.GU: (H, 2 * INTER),
                kd.DOWN: (INTER, H)}[r[0]]
        tiles, groups = n // tile, k // 128
        assert r[1:7] == [row, kd.share(tiles, groups, 8), tiles * groups, groups, n, s]
        assert r[7] == {kd.QKV: off["xn"], kd.O: off["attn"], kd.GU: off["xn"],
                        kd.DOWN: off["act"]}[r[0]]
        if r[0] in (kd.O, kd.DOWN):  # the norm after it: post-attention, next layer's input
            assert r[8] == (2 * layer + (1 if r[0] == kd.O else 2)) * H
        row += tiles * groups * 16
        s += groups * n
    assert dl.words.shape == (row, tile)
    assert dl.sz_rows.shape == (row // 16, tile)  # a unit's scales row: its first row / 16
    assert torch.equal(dl.norms.view(-1, H), d["norms"])  # in, post-attention, ..., final
    pos = d["pos"]
    assert d["slot"] == int(d["block_table"][pos // 16]) * 16 + pos % 16


def test_what_the_kernel_refuses() -> None:
    d, cfg = _build(4, layers=1)
    dims, w = bench.dims_of(cfg), d["weights"]
    assert kd.unsupported(dims, w, torch.bfloat16, programs=8, splits=4) is None
    assert "bf16 only" in kd.unsupported(dims, w, torch.float16)
    assert "four query heads" in kd.unsupported(bench.dims_of(dict(cfg, KVH=4)), w,
                                                torch.bfloat16)
    assert "fewer than the attention" in kd.unsupported(dims, w, torch.bfloat16, programs=8)
    assert "KV width" in kd.unsupported(dims, w, torch.bfloat16, warps=8)  # one KV head
    q = w[0].o.unpacked()
    eight = WNA16Layout.build(q, w[0].o.scales.float(), None, None, 8, torch.bfloat16)
    assert "8-bit" in kd.unsupported(dims, [w[0]._replace(o=eight)], torch.bfloat16)
    with pytest.raises(ValueError, match="decode_layers: .*bf16 only"):
        kd.DecodeLayers(dims, [w[0]._replace(qkv=WNA16Layout.build(
            w[0].qkv.unpacked(), w[0].qkv.scales.float(), None, None, 4, torch.float16))],
            d["norms"][-1], CPU, splits=4, programs=8)
    dl = d["dl"]
    with pytest.raises(ValueError, match="caches for 1 layers"):
        dl.bind_caches(d["caches"] * 2)
    with pytest.raises(ValueError, match="contiguous bf16"):
        dl.bind_caches([(c[0].float(), c[1]) for c in d["caches"]])


@pytest.mark.parametrize("ctx,warps", ((1, 4), (37, 4), (37, 8)))
def test_the_reference_without_roundings_is_transformers_llama(ctx: int, warps: int) -> None:
    """Two layers with the dequantized weights and the cache's earlier K/V as transformers'
    past: the final hidden state after the final norm agrees to float32 rounding."""
    from transformers import DynamicCache, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaModel
    layers = 2
    d, cfg = _build(warps, layers, ctx)
    want = bench.reference_layers(d, rounding=False)
    H, HEADS, KVH, D, INTER, BS = (cfg[k] for k in ("H", "HEADS", "KVH", "D", "INTER", "BS"))
    hc = LlamaConfig(vocab_size=32, hidden_size=H, intermediate_size=INTER,
                     num_hidden_layers=layers, num_attention_heads=HEADS,
                     num_key_value_heads=KVH, head_dim=D, rms_norm_eps=cfg["eps"],
                     rope_theta=cfg["theta"], max_position_embeddings=1024)
    model = LlamaModel(hc).float().eval()
    norms = d["norms"].float()
    with torch.no_grad():
        for n, (layer, w) in enumerate(zip(model.layers, d["weights"])):
            qkv = w.qkv.dequantize(torch.float32)
            layer.self_attn.q_proj.weight.copy_(qkv[:HEADS * D])
            layer.self_attn.k_proj.weight.copy_(qkv[HEADS * D:(HEADS + KVH) * D])
            layer.self_attn.v_proj.weight.copy_(qkv[(HEADS + KVH) * D:])
            layer.self_attn.o_proj.weight.copy_(w.o.dequantize(torch.float32))
            gu = w.gate_up.dequantize(torch.float32)
            layer.mlp.gate_proj.weight.copy_(gu[:INTER])
            layer.mlp.up_proj.weight.copy_(gu[INTER:])
            layer.mlp.down_proj.weight.copy_(w.down.dequantize(torch.float32))
            layer.input_layernorm.weight.copy_(norms[2 * n])
            layer.post_attention_layernorm.weight.copy_(norms[2 * n + 1])
        model.norm.weight.copy_(norms[2 * layers])
    pos = d["pos"]
    cache = DynamicCache(config=hc)
    toks = torch.arange(pos)
    slots = d["block_table"].long()[toks // BS] * BS + toks % BS
    for n in range(layers):
        k = d["caches"][n][0].reshape(-1, KVH, D)[slots].float().permute(1, 0, 2)[None]
        v = d["caches"][n][1].reshape(-1, KVH, D)[slots].float().permute(1, 0, 2)[None]
        cache.update(k, v, n)
    params = inspect.signature(model.forward).parameters
    kw = {"cache" if "cache" in params else "past_key_values": cache}
    with torch.no_grad():
        out = model(inputs_embeds=d["h0"].float()[None], position_ids=torch.tensor([[pos]]),
                    use_cache=True, **kw)
    got = out.last_hidden_state[0, 0]
    h = want["h"]
    mine = h * torch.rsqrt(h.pow(2).mean() + cfg["eps"]) * norms[2 * layers]
    assert (got - mine).abs().max() <= 1e-4 * mine.abs().max()
    # and the rounded reference (the GPU kernel's) stays near it
    rounded = bench.reference_layers(d)
    assert (rounded["h"] - h).pow(2).mean().sqrt() <= 2e-2 * h.pow(2).mean().sqrt()


def _attention_as_the_kernel_walks_it(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      splits: int, tb: int) -> torch.Tensor:
    """One KV head's attention for its query rows q (G, D) over the context's rows k, v (ctx,
    D), transcribed from the kernel: each share of _attn_share's split, its first block of tb
    tokens then the rest a block at a time with _online's update (scores in log2 units, the
    -inf guard), stored (m, l, acc), then _merge."""
    ctx, d = k.shape
    log2e = 1.4426950408889634
    qs = q * (d ** -0.5 * log2e)
    parts = []
    for sp in range(splits):
        per = -(-ctx // splits)
        t0 = min(sp * per, ctx)
        t1 = min(t0 + per, ctx)
        m = torch.full((q.shape[0],), float("-inf"))
        lsum = torch.zeros(q.shape[0])
        acc = torch.zeros(q.shape[0], d)
        tb0 = t0
        while True:  # the first block always, then while tb < t1
            tok = tb0 + torch.arange(tb)
            ok = tok < t1
            idx = tok.clamp(max=ctx - 1)
            kt = torch.where(ok[:, None], k[idx], 0.0)
            vt = torch.where(ok[:, None], v[idx], 0.0)
            s = torch.where(ok[None, :], qs @ kt.t(), float("-inf"))  # (G, tb)
            m_new = torch.maximum(m, s.max(1).values)
            m_sub = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = torch.exp2(m - m_sub)
            p = torch.exp2(s - m_sub[:, None])
            lsum = lsum * alpha + p.sum(1)
            acc = acc * alpha[:, None] + p @ vt
            m = m_new
            tb0 += tb
            if tb0 >= t1:
                break
        parts.append((m, lsum, acc))
    big = torch.stack([p[0] for p in parts]).max(0).values
    num = sum(torch.exp2(m - big)[:, None] * acc for m, _, acc in parts)
    den = sum(torch.exp2(m - big) * lsum for m, lsum, _ in parts)
    return num / den[:, None]


@pytest.mark.parametrize("ctx", (1, 2, 15, 16, 17, 40, 256, 300, 1000))
def test_the_attention_shares_and_merge_are_softmax_attention(ctx: int) -> None:
    """Empty shares (fewer tokens than splits), one block a share, and several blocks a share
    (contexts past splits x tb tokens): the kernel's walk is softmax attention, no NaN."""
    g = torch.Generator().manual_seed(ctx)
    q, k, v = (torch.randn(n, 128, generator=g) for n in (4, ctx, ctx))
    got = _attention_as_the_kernel_walks_it(q, k, v, 16, 16)
    want = torch.softmax(q @ k.t() / 128 ** 0.5, -1) @ v
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
