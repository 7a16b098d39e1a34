"""Tensor-parallel layers: a model split over 2 CPU processes (gloo) gives the unsplit model's logits."""
from __future__ import annotations


import pytest
import torch

from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.testing.gloo import run_on_gloo_ranks
from peregrine.testing.steps import one_prefill

WORLD = 2
TOKENS = [5, 17, 99, 230, 41, 8, 77, 301, 12, 64, 150, 9]


def _logits(path: str) -> torch.Tensor:
    """Logits of one prefill through the paged torch backend, built on whatever TP group is active."""
    from peregrine.attention import get_attention_backend
    from peregrine.config import EngineArgs
    from peregrine.worker.loader import load_model

    cfg = EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config().model
    model = load_model(cfg, get_attention_backend("torch"), torch.device("cpu"))
    caches, meta = one_prefill(cfg, len(TOKENS))
    with torch.inference_mode():
        hidden = model(torch.tensor(TOKENS), torch.arange(len(TOKENS)), caches, meta)
        return model.compute_logits(hidden)  # (T, V)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_way_tensor_parallel_matches_single_process(arch: str) -> None:
    path = str(tiny_checkpoint(arch))
    want = _logits(path)
    got = run_on_gloo_ranks(_logits, WORLD, path)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
