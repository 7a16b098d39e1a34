"""The persistent decode-layer kernel's host side (its Gluon kernel runs on the GPU only): the
gate/up channel order its tiles read, the phase table, and the torch layers its GPU check
compares with, which without their roundings are transformers' Llama layers."""
from __future__ import annotations

import inspect

import pytest
import torch
from benchmark_scripts import load

mod = load("decode_layer_ring")
CFG = {"H": 256, "HEADS": 4, "KVH": 1, "D": 128, "INTER": 512, "BS": 16, "theta": 10000.0,
       "eps": 1e-6}
# eight consumer warps: tiles of 256 channels, two heads
CFG8 = dict(CFG, H=512, HEADS=8, KVH=2, INTER=1024)


@pytest.mark.parametrize("half", (64, 128))
def test_a_gate_up_tile_is_gate_channels_then_the_same_up_channels(half: int) -> None:
    inter = 512
    order = mod.gate_up_order(inter, half)
    assert sorted(order.tolist()) == list(range(2 * inter))
    tiles = order.view(-1, 2 * half)
    for j, tile in enumerate(tiles.tolist()):
        assert tile[:half] == list(range(half * j, half * j + half))
        assert tile[half:] == [inter + c for c in range(half * j, half * j + half)]


def test_a_units_scales_row_holds_each_channel_quads_scales_then_zero_points() -> None:
    from peregrine.layers.quantization.wna16 import WNA16Layout
    k, n, tile = 256, 96, 32
    q = torch.randint(0, 16, (k, n), dtype=torch.int32)
    zp = torch.randint(0, 16, (k // 128, n)).float()
    w = WNA16Layout.build(q, torch.rand(k // 128, n) + 0.5, zp, None, 4, torch.bfloat16)
    rows = mod.tile_scales(w, tile)
    groups = k // 128
    assert rows.shape == (groups * n // tile, tile)
    s16 = (w.scales.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
    z16 = (w.zeros.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
    for u in range(rows.shape[0]):
        i, j = divmod(u, groups)  # tile-major, as tile_words
        for quad in range(tile // 4):
            c = tile * i + 4 * quad
            got = (rows[u, 4 * quad:4 * quad + 4].to(torch.int64) & 0xFFFFFFFF).tolist()
            want = [s16[j][c] | s16[j][c + 1] << 16, s16[j][c + 2] | s16[j][c + 3] << 16,
                    z16[j][c] | z16[j][c + 1] << 16, z16[j][c + 2] | z16[j][c + 3] << 16]
            assert got == want, (u, quad)


@pytest.mark.parametrize("warps", (4, 8))
def test_the_packed_weights_are_each_projections_weight(warps: int) -> None:
    """Every phase's words and scale rows, read as the kernel reads them through the table, are
    the layout's dequantized weight bit for bit (gate/up in the kernel's channel order)."""
    cfg = CFG if warps == 4 else CFG8
    d = mod.build(2, 8, 20, torch.device("cpu"), cfg, warps=warps)
    f = 0
    for layer in range(2):
        for kind in (mod.QKV, mod.ATTN, mod.O, mod.GU, mod.DOWN):
            if kind == mod.ATTN:
                with pytest.raises(ValueError, match="no weight"):
                    mod.unpack_phase(d, f)
            else:
                want = d["layouts"][layer][kind].dequantize(torch.float32).t()
                assert torch.equal(mod.unpack_phase(d, f), want), (layer, kind)
            f += 1


@pytest.mark.parametrize("warps", (4, 8))
def test_the_phase_table_walks_each_layer_in_five_phases(warps: int) -> None:
    cfg = CFG if warps == 4 else CFG8
    d = mod.build(2, 8, 37, torch.device("cpu"), cfg, warps=warps)
    table = d["table"].tolist()
    H, INTER, QD, tile = cfg["H"], cfg["INTER"], cfg["HEADS"] * 128, 32 * warps
    qkv = (cfg["HEADS"] + 2 * cfg["KVH"]) * 128
    off = mod.offsets(cfg)
    assert [r[0] for r in table] == [mod.QKV, mod.ATTN, mod.O, mod.GU, mod.DOWN] * 2
    row = s = 0
    for f, r in enumerate(table):
        layer = f // 5
        assert r[9] == layer * d["blocks_a_layer"] * cfg["BS"]  # the layer's own cache
        if r[0] == mod.ATTN:
            assert r[2:4] == [0, 0]  # no weight units
            continue
        k, n = {mod.QKV: (H, qkv), mod.O: (QD, H), mod.GU: (H, 2 * INTER),
                mod.DOWN: (INTER, H)}[r[0]]
        tiles, groups = n // tile, k // 128
        assert r[1:7] == [row, mod.share(tiles, groups, 8), tiles * groups, groups, n, s]
        assert r[7] == {mod.QKV: off["xn"], mod.O: off["attn"], mod.GU: off["xn"],
                        mod.DOWN: off["act"]}[r[0]]
        if r[0] in (mod.O, mod.DOWN):  # the norm after it: post-attention, next layer's input
            assert r[8] == (2 * layer + (1 if r[0] == mod.O else 2)) * H
        row += tiles * groups * 16
        s += groups * n
    assert d["words"].shape == (row, tile)
    assert d["sz_rows"].shape == (row // 16, tile)  # a unit's scales row: its first row / 16
    with pytest.raises(ValueError, match="whole heads"):
        mod.build(1, 8, 4, torch.device("cpu"), CFG, warps=8)  # one KV head: half a tile
    pos = d["pos"]
    assert d["slot"] == int(d["block_table"][pos // 16]) * 16 + pos % 16


@pytest.mark.parametrize("ctx,warps", ((1, 4), (37, 4), (37, 8)))
def test_the_reference_without_roundings_is_transformers_llama(ctx: int, warps: int) -> None:
    """Two layers with the dequantized weights and the cache's earlier K/V as transformers'
    past: the final hidden state after the final norm agrees to float32 rounding."""
    from transformers import DynamicCache, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaModel
    layers = 2
    cfg = CFG if warps == 4 else CFG8
    d = mod.build(layers, 8, ctx, torch.device("cpu"), cfg, warps=warps)
    want = mod.reference_layers(d, rounding=False)
    H, HEADS, KVH, D, INTER, BS = (cfg[k] for k in ("H", "HEADS", "KVH", "D", "INTER", "BS"))
    hc = LlamaConfig(vocab_size=32, hidden_size=H, intermediate_size=INTER,
                     num_hidden_layers=layers, num_attention_heads=HEADS,
                     num_key_value_heads=KVH, head_dim=D, rms_norm_eps=cfg["eps"],
                     rope_theta=cfg["theta"], max_position_embeddings=1024)
    model = LlamaModel(hc).float().eval()
    norms = d["norms"].float().view(-1, H)
    with torch.no_grad():
        for n, (layer, w) in enumerate(zip(model.layers, d["layouts"])):
            qkv = w[mod.QKV].dequantize(torch.float32)
            layer.self_attn.q_proj.weight.copy_(qkv[:HEADS * D])
            layer.self_attn.k_proj.weight.copy_(qkv[HEADS * D:(HEADS + KVH) * D])
            layer.self_attn.v_proj.weight.copy_(qkv[(HEADS + KVH) * D:])
            layer.self_attn.o_proj.weight.copy_(w[mod.O].dequantize(torch.float32))
            gu = torch.empty(2 * INTER, H)
            gu[d["order"]] = w[mod.GU].dequantize(torch.float32)
            layer.mlp.gate_proj.weight.copy_(gu[:INTER])
            layer.mlp.up_proj.weight.copy_(gu[INTER:])
            layer.mlp.down_proj.weight.copy_(w[mod.DOWN].dequantize(torch.float32))
            layer.input_layernorm.weight.copy_(norms[2 * n])
            layer.post_attention_layernorm.weight.copy_(norms[2 * n + 1])
        model.norm.weight.copy_(norms[2 * layers])
    pos = d["pos"]
    cache = DynamicCache(config=hc)
    toks = torch.arange(pos)
    for n in range(layers):
        slots = (n * d["blocks_a_layer"] * BS + d["block_table"].long()[toks // BS] * BS
                 + toks % BS)
        k = d["k_cache"].view(-1, KVH, D)[slots].float().permute(1, 0, 2)[None]
        v = d["v_cache"].view(-1, KVH, D)[slots].float().permute(1, 0, 2)[None]
        cache.update(k, v, n)
    params = inspect.signature(model.forward).parameters
    kw = {"cache" if "cache" in params else "past_key_values": cache}
    with torch.no_grad():
        out = model(inputs_embeds=d["h0"].float()[None, None],
                    position_ids=torch.tensor([[pos]]), use_cache=True, **kw)
    got = out.last_hidden_state[0, 0]
    h = want["h"]
    mine = h * torch.rsqrt(h.pow(2).mean() + cfg["eps"]) * norms[2 * layers]
    assert (got - mine).abs().max() <= 1e-4 * mine.abs().max()
    # and the rounded reference (the GPU kernel's) stays near it
    rounded = mod.reference_layers(d)
    assert (rounded["h"] - h).pow(2).mean().sqrt() <= 2e-2 * h.pow(2).mean().sqrt()
