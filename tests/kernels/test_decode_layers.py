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


def test_placing_on_more_programs_shares_every_projection_again() -> None:
    d, cfg = _build(4)
    dl = d["dl"]
    before = dl.table.clone()
    dl.place(16)
    for old, r in zip(before.tolist(), dl.table.tolist()):
        if r[0] == kd.ATTN:
            assert r == old
            continue
        assert r[:2] == old[:2] and r[3:] == old[3:]  # only the units a program change
        assert r[2] == kd.share(r[3] // r[4], r[4], 16) <= old[2]
        assert 16 * r[2] >= r[3]  # every unit has a program
    pieces = max(-(-r[4] // r[2]) + 1 for r in dl.table.tolist() if r[0] != kd.ATTN)
    assert dl.part.numel() == pieces * int(dl.table[:, 5].max())
    assert dl.times.shape[1] == dl.programs == 16
    dl.place(8)
    assert torch.equal(dl.table, before)
    with pytest.raises(ValueError, match="fewer than the attention"):
        dl.place(dl.dims.kv_heads * dl.splits - 1)


@pytest.mark.parametrize("faster", kd.PLACEMENTS)
def test_the_faster_placement_is_kept(faster: tuple[int, int]) -> None:
    """choose_placement times every placement (programs an SM, ring stages) and leaves the
    table shared out for the fastest; a placement refused before its launch (its programs
    could not all be resident) counts as never faster."""
    d, _ = _build(4)
    dl = d["dl"]
    sms = dl.programs
    seen = []

    def timer(run, iters):
        run()
        form = (dl.programs // sms, dl.stages)
        seen.append(form)
        return 1.0 if form == faster else 2.0

    times = dl.choose_placement(lambda: None, timer=timer)
    assert seen == list(kd.PLACEMENTS) and set(times) == set(kd.PLACEMENTS)
    assert (dl.programs // sms, dl.stages) == faster
    for r in dl.table.tolist():
        if r[0] != kd.ATTN:
            assert r[2] == kd.share(r[3] // r[4], r[4], dl.programs)

    def refused(run, iters):
        if dl.programs > sms:
            raise ValueError("decode_layers: not resident at once")
        return 5.0

    times = dl.choose_placement(lambda: None, timer=refused)
    assert (dl.programs, dl.stages) == (sms, kd.PLACEMENTS[0][1])
    assert times[kd.PLACEMENTS[1]] == float("inf")


def test_what_the_kernel_refuses() -> None:
    d, cfg = _build(4, layers=1)
    dims, w = bench.dims_of(cfg), d["weights"]
    assert kd.unsupported(dims, w, torch.bfloat16, programs=8, splits=4) is None
    assert "bf16 only" in kd.unsupported(dims, w, torch.float16)
    assert "four query heads" in kd.unsupported(bench.dims_of(dict(cfg, KVH=4)), w,
                                                torch.bfloat16)
    assert "fewer than the attention" in kd.unsupported(dims, w, torch.bfloat16, programs=8)
    assert "0 attention programs" in kd.unsupported(dims, w, torch.bfloat16, splits=0)
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


def test_the_attention_takes_as_many_programs_a_kv_head_as_the_sms_allow() -> None:
    assert kd.attention_splits(132, 8) == 16  # H100 / H200 SXM
    assert kd.attention_splits(114, 8) == 14  # H100 PCIe
    assert kd.attention_splits(78, 8) == 9
    assert kd.attention_splits(132, 1) == 16
    assert kd.attention_splits(4, 8) == 0  # (refused: fewer SMs than KV heads)


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


@pytest.mark.parametrize("warps", (4, 8))
def test_the_prologue_reads_the_tokens_row_and_clears_the_tickets(warps: int) -> None:
    """The prologue kernel (interpreted here): h is the token's embedding row, xn = h * g (the
    first input norm's weight) rounded once, each tile's sum of h^2, xn's sums a block of 64
    at a time (where the input-sum form reads them); and the phases' counters and tickets a
    run left behind are zero again."""
    d, cfg = _build(warps, layers=1)
    dl, H, tile = d["dl"], cfg["H"], 32 * warps
    table = torch.randn(11, H).to(torch.bfloat16)
    dl.lock.fill_(3)
    dl.cnt.fill_(7)
    dl.vec.fill_(5.0)
    kd.decode_prologue_kernel[(H // tile,)](
        table, torch.tensor([6]), dl.norms, dl.vec, dl.sums, dl.lock, dl.cnt, dl.lock.numel(),
        dl.cnt.numel(), H=H, T=tile)
    h = table[6].float()
    assert torch.equal(dl.vec[:H].float(), h)
    # (within one bf16 step: the interpreter's float32 -> bf16 conversion may truncate)
    torch.testing.assert_close(dl.vec[H:2 * H].float(), (h * dl.norms[:H].float()).bfloat16()
                               .float(), rtol=2 ** -7, atol=0)
    torch.testing.assert_close(dl.ss, h.pow(2).view(-1, tile).sum(1), rtol=1e-5, atol=0)
    at = kd.block_sums_at(H) + H // 64  # (xn: the arena's second vector)
    xn = dl.vec[H:2 * H].float()
    torch.testing.assert_close(dl.sums[at:at + H // 64], xn.view(-1, 64).sum(1), rtol=1e-5,
                               atol=1e-5)
    assert not dl.lock.any() and not dl.cnt.any()
    assert (dl.vec[2 * H:] == 5.0).all()  # nothing past xn is touched


def _emulate(d: dict, fold: int) -> dict:
    """The kernel's phases transcribed in torch, driven by DecodeLayers' table and buffers as
    the kernel reads them (each projection's weight through `unpack`, its input at the table's
    offset, the norm weight at its offset, each layer's caches at its offsets from layer 0's),
    with the tiles' finishes (or, folded, attention making q, k and v from the projection) as
    the kernel does them; float32 sums in torch's order."""
    dl = d["dl"]
    dims, tile = dl.dims, 32 * dl.warps
    H, HEADS, KVH, D, BS = dims.hidden, dims.heads, dims.kv_heads, dims.head_dim, dims.block_size
    off = kd.offsets(dims)
    vec = torch.zeros(off["size"])
    norms = dl.norms.float()
    h0 = d["h0"].float().reshape(H)
    vec[:H] = h0
    vec[H:2 * H] = (h0 * norms[:H]).bfloat16().float()
    ss = h0.pow(2).view(-1, tile).sum(1)
    k0, v0 = d["caches"][0]
    kflat, vflat = d["k_cache"].view(-1), d["v_cache"].view(-1)  # the caches' storage
    base_k = (k0.data_ptr() - d["k_cache"].data_ptr()) // 2
    base_v = (v0.data_ptr() - d["v_cache"].data_ptr()) // 2
    pos, slot = d["pos"], d["slot"]
    cs = d["cos_sin"][pos]
    rope_sign = torch.cat([-torch.ones(64), torch.ones(64)])
    qkv_y = None

    def rope(y):  # (heads, D), partner c ^ 64
        partner = torch.cat([y[:, 64:], y[:, :64]], 1)
        cos, sin = cs[:64].repeat(2), cs[64:].repeat(2)
        return (y * cos + rope_sign * partner * sin).bfloat16().float()

    for f, row in enumerate(dl.table.tolist()):
        kind, _, _, _, groups, n, _, x_off, g_off, k_off, v_off = row
        kc = kflat[base_k + k_off:].view(-1, KVH, D) if k_off >= 0 else None
        vc = vflat[base_v + v_off:].view(-1, KVH, D)
        rr = torch.rsqrt(ss.sum() / H + dims.eps)
        if kind == kd.ATTN:
            y = (qkv_y * rr).bfloat16().float()
            heads = y.view(-1, D)
            q = rope(heads[:HEADS])
            k = rope(heads[HEADS:HEADS + KVH])
            v = heads[HEADS + KVH:]
            if fold:
                vec[off["q"]:off["attn"]] = q.reshape(-1)
                kc[slot], vc[slot] = k.bfloat16(), v.bfloat16()
            toks = torch.arange(pos + 1)
            rows = d["block_table"].long()[toks // BS] * BS + toks % BS
            kk = kc[rows].float().repeat_interleave(HEADS // KVH, 1)
            vv = vc[rows].float().repeat_interleave(HEADS // KVH, 1)
            qv = vec[off["q"]:off["attn"]].view(HEADS, D)
            att = torch.softmax(torch.einsum("hd,thd->ht", qv, kk) / D ** 0.5, -1)
            vec[off["attn"]:off["act"]] = torch.einsum("ht,thd->hd", att, vv).reshape(-1) \
                .bfloat16().float()
            continue
        x = vec[x_off:x_off + groups * 128]
        y = x @ dl.unpack(f)  # (n,)
        if kind == kd.QKV:
            qkv_y = y
            if not fold:  # the tiles' finish
                yr = (y * rr).bfloat16().float().view(-1, D)
                vec[off["q"]:off["attn"]] = rope(yr[:HEADS]).reshape(-1)
                kc[slot] = rope(yr[HEADS:HEADS + KVH]).bfloat16()
                vc[slot] = yr[HEADS + KVH:].bfloat16()
        elif kind == kd.GU:
            g_u = (y * rr).bfloat16().float().view(-1, 2, tile // 2)
            gate, up = g_u[:, 0].reshape(-1), g_u[:, 1].reshape(-1)
            vec[off["act"]:] = (gate / (1 + torch.exp(-gate)) * up).bfloat16().float()
        else:  # o, down
            h = (vec[:H] + y.bfloat16().float()).bfloat16().float()
            vec[:H] = h
            vec[H:2 * H] = (h * norms[g_off:g_off + H]).bfloat16().float()
            ss = h.pow(2).view(-1, tile).sum(1)
    return {"h": vec[:H], "xn": vec[H:2 * H],
            "k": torch.stack([c[0].reshape(-1, KVH, D)[slot] for c in d["caches"]]).float(),
            "v": torch.stack([c[1].reshape(-1, KVH, D)[slot] for c in d["caches"]]).float(),
            "q": vec[off["q"]:off["attn"]].view(-1, D), "attn": vec[off["attn"]:off["act"]],
            "act": vec[off["act"]:]}


@pytest.mark.parametrize("warps,fold", ((4, 0), (4, 1), (8, 0), (8, 1)))
def test_the_table_driven_phases_are_the_reference_layers(warps: int, fold: int) -> None:
    """The kernel's data flow through DecodeLayers' table, offsets and packed weights (transcribed
    in torch) gives the reference layers' outputs: every input, norm weight, cache row and
    finish is where the table says. Sums in another order flip a rounding now and then, and a
    flip moves what follows it: one layer within a few ulps, three within a relative RMS."""
    for layers, bound in ((1, bench.ONE_LAYER), (3, bench.LAYERS)):
        d, _ = _build(warps, layers=layers, ctx=37)
        bad = bench.mismatches(_emulate(d, fold), bench.reference_layers(d), *bound)
        assert not bad, (layers, bad)
