"""Pipeline stages' CUDA graphs on one GPU, in one process: each stage captures its decode and
piecewise graphs over its own layers with fixed (hidden, residual) input and output buffers;
replayed one stage after another (each stage's padded output copied into the next one's input)
they give the whole model's graphs' hidden states and logits (float32)."""
from __future__ import annotations

import pytest
import torch

from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.testing.stage_graphs import whole_and_staged

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch,partition", [("llama", (2, 1)), ("qwen3", (1, 1, 1))])
def test_stage_graphs_replayed_in_turn_give_the_whole_models_graphs_results(arch: str,
                                                                            partition) -> None:
    path = str(tiny_checkpoint(arch, num_hidden_layers=sum(partition)))
    results = whole_and_staged(path, torch.device("cuda"), partition, capture=True)
    for name, (want, got) in results.items():
        assert got.shape == want.shape and torch.isfinite(want).all(), name
        # NOTE: the same kernels on the same shapes; a tolerance only for a library that picks
        # another GEMM algorithm inside another graph.
        rms = want.pow(2).mean().sqrt().item()
        assert (got - want).abs().max().item() <= 1e-5 * rms, name
