"""Decode attention as the persistent kernel walks it (kernels/ring_attention.py; its Gluon code
runs on the GPU only), transcribed on the CPU: its shares, blocks, online softmax and merge are
softmax attention."""
from __future__ import annotations

import pytest
import torch


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
