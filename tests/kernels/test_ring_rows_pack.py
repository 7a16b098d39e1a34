"""The row-tile probe's weight layout (benchmarks/ring_rows_probe.py): each 16-channel tile's
chunks of 8 groups, read in the order its kernel's lanes read them, give x @ dequant(W).
(The kernel itself is Gluon and runs on the GPU only.)"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from benchmarks.ring_rows_probe import emulate, pack  # noqa: E402
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


def test_a_misplaced_word_or_scale_shows() -> None:
    w = _weights(1024, 16, 3)
    rows = pack(w.qweight, w.scales, w.zeros)
    x = torch.randn(1024, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = emulate(rows, x, 16)
    for r, c0, c1 in ((0, 0, 1), (3, 5, 37), (16, 0, 8)):  # two words, then two scale words
        bad = rows.clone()
        bad[r, c0], bad[r, c1] = rows[r, c1], rows[r, c0]
        assert (emulate(bad, x, 16) - want).abs().max() > 1e-3
