"""benchmarks/ablate.py: the named parts of a step are replaced by stand-ins that launch
nothing and keep the shapes, then the CLI runs; unknown parts refused."""
from __future__ import annotations

import pytest
import torch

from benchmark_scripts import load


@pytest.fixture
def restored(monkeypatch):
    """The attributes ablate.py replaces, put back after the test."""
    import peregrine.kernels.activation as act
    import peregrine.kernels.rmsnorm as rms
    import peregrine.kernels.rope_store as rs
    import peregrine.kernels.wna16_gemv as gemv
    from peregrine.layers.attention import Attention
    from peregrine.layers.embedding import ParallelLMHead
    for owner, name in [(rms, "rms_norm"), (rs, "norm_rope_store"), (gemv, "wna16_gemv"),
                        (act, "silu_and_mul"), (Attention, "forward"),
                        (ParallelLMHead, "compute_logits")]:
        monkeypatch.setattr(owner, name, getattr(owner, name))
    return monkeypatch


def test_left_out_parts_keep_shapes_then_the_cli_runs(restored) -> None:
    import peregrine.entrypoints.cli as cli
    ab = load("ablate")
    seen = []
    restored.setattr(cli, "main", lambda argv: seen.append(argv) or 0)
    assert ab.main(["norm,act,gemv", "--", "bench", "latency"]) == 0
    assert seen == [["bench", "latency"]]
    import peregrine.kernels.activation as act
    import peregrine.kernels.rmsnorm as rms
    import peregrine.kernels.wna16_gemv as gemv
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    w = torch.ones(8)
    assert rms.rms_norm(x, w, 1e-6) is x
    out, res = rms.rms_norm(x, w, 1e-6, r)
    assert out is x and res is r
    assert act.silu_and_mul(torch.randn(2, 10)).shape == (2, 5)

    class Layout:
        out_features = 12
    assert gemv.wna16_gemv(x, Layout()).shape == (3, 12)


def test_attention_stand_in_returns_the_flat_query(restored) -> None:
    import peregrine.entrypoints.cli as cli
    from peregrine.layers.attention import Attention
    ab = load("ablate")
    restored.setattr(cli, "main", lambda argv: 0)
    ab.main(["attention", "--"])
    layer = Attention.__new__(Attention)
    layer.num_heads, layer.head_dim = 4, 2
    q = torch.randn(3, 4, 2)
    assert torch.equal(Attention.forward(layer, q, None, None, (None, None), None), q.reshape(3, 8))


def test_lm_head_stand_in_gives_zero_logits(restored) -> None:
    import peregrine.entrypoints.cli as cli
    from peregrine.layers.embedding import ParallelLMHead
    ab = load("ablate")
    restored.setattr(cli, "main", lambda argv: 0)
    ab.main(["lm_head", "--"])
    head = ParallelLMHead.__new__(ParallelLMHead)
    head.vocab_size = 7
    logits = ParallelLMHead.compute_logits(head, torch.randn(3, 4))
    assert logits.shape == (3, 7) and logits.dtype == torch.float32 and not logits.any()
    out = torch.ones(3, 7)
    assert ParallelLMHead.compute_logits(head, torch.randn(3, 4), out) is out and not out.any()


@pytest.mark.parametrize("argv, message", [
    (["norm,bogus", "--", "bench"], "unknown part"),
    (["norm", "bench"], "ablate"),
])
def test_refuses_what_it_cannot_apply(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        load("ablate").main(argv)
