"""Tensor-parallel linear layers load their shard of each checkpoint tensor: ranks are simulated
in one process, so the exact slices are checked without a process group."""
from __future__ import annotations

import pytest
import torch

import peregrine.layers.linear as linear
from peregrine.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                     QKVParallelLinear, RowParallelLinear)

WORLD = 2


def _on_rank(monkeypatch, rank: int, build):
    monkeypatch.setattr(linear, "tp_size", lambda: WORLD)
    monkeypatch.setattr(linear, "tp_rank", lambda: rank)
    return build()


def test_merged_column_shards_each_projection(monkeypatch) -> None:
    gate, up = torch.randn(8, 6), torch.randn(8, 6)  # (out, in) each
    x = torch.randn(3, 6)  # (T, in)
    outs = []
    for rank in range(WORLD):
        layer = _on_rank(monkeypatch, rank, lambda: MergedColumnParallelLinear(
            6, [8, 8], dtype=torch.float32, shard_names=("gate_proj", "up_proj")))
        layer.weight_loader(layer.weight, gate, 0, "gate_proj.weight")
        layer.weight_loader(layer.weight, up, 1, "up_proj.weight")
        outs.append(layer(x).split(4, dim=-1))  # this rank's (gate, up) slices
    torch.testing.assert_close(torch.cat([o[0] for o in outs], -1), x @ gate.T)
    torch.testing.assert_close(torch.cat([o[1] for o in outs], -1), x @ up.T)


def test_qkv_shards_heads_and_bias(monkeypatch) -> None:
    q, k, v = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 4)  # 4 q heads, 2 kv, D = 2
    bq, bk, bv = torch.randn(8), torch.randn(4), torch.randn(4)
    layer = _on_rank(monkeypatch, 1, lambda: QKVParallelLinear(4, 2, 4, 2, bias=True,
                                                               dtype=torch.float32))
    assert layer.prefixes == ["q_proj", "k_proj", "v_proj"]
    for i, (w, b) in enumerate(((q, bq), (k, bk), (v, bv))):
        layer.weight_loader(layer.weight, w, i, f"w{i}")
        layer.weight_loader(layer.bias, b, i, f"b{i}")
    assert torch.equal(layer.weight, torch.cat([q[4:], k[2:], v[2:]]))
    assert torch.equal(layer.bias, torch.cat([bq[4:], bk[2:], bv[2:]]))


def test_row_parallel_partial_sums_add_up(monkeypatch) -> None:
    w, b = torch.randn(5, 8), torch.randn(5)
    x = torch.randn(3, 8)
    total = 0
    for rank in range(WORLD):
        layer = _on_rank(monkeypatch, rank, lambda: RowParallelLinear(8, 5, bias=True,
                                                                      dtype=torch.float32))
        layer.weight_loader(layer.weight, w, None, "w")
        layer.weight_loader(layer.bias, b, None, "b")  # whole on every rank
        total = total + layer(x[:, rank * 4:(rank + 1) * 4]) - b  # no all-reduce in one process
    torch.testing.assert_close(total + b, x @ w.T + b)


def test_wrong_shapes_and_unsplit_tensors_are_named(monkeypatch) -> None:
    col = _on_rank(monkeypatch, 0, lambda: ColumnParallelLinear(6, 8, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"'a\.weight'.*\(8, 6\)"):
        col.weight_loader(col.weight, torch.randn(8, 5), None, "a.weight")
    merged = MergedColumnParallelLinear(6, [8, 8], dtype=torch.float32,
                                        shard_names=("gate_proj", "up_proj"))
    with pytest.raises(ValueError, match="must be split into its projections"):
        merged.weight_loader(merged.weight, torch.randn(16, 6), None, "gate_up_proj.weight")


def test_layers_take_their_dtype_explicitly() -> None:
    before = torch.get_default_dtype()
    layer = QKVParallelLinear(4, 2, 4, 2, bias=True, dtype=torch.bfloat16)
    assert layer.weight.dtype == layer.bias.dtype == torch.bfloat16
    assert torch.get_default_dtype() == before
