"""Pipeline stages through their graph runners (eager here: capture=False), in one process: a
prompt through the piecewise runners and a decode step through the decode runners of the
stages one after another, each stage's padded output copied into the next one's fixed input
buffer, give the whole model's hidden states and logits bit for bit (float32, Triton attention
under the interpreter)."""
from __future__ import annotations

import pytest
import torch

from peregrine.models.protocol import PipelineStage
from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.testing.stage_graphs import whole_and_staged
from peregrine.worker.step_buffers import StageBuffers


@pytest.mark.parametrize("arch,partition", [("llama", (2, 1)), ("qwen3", (1, 1, 1))])
def test_stages_through_their_graph_runners_give_the_whole_models_results(arch: str,
                                                                          partition) -> None:
    path = str(tiny_checkpoint(arch, num_hidden_layers=sum(partition)))
    results = whole_and_staged(path, torch.device("cpu"), partition, capture=False)
    for name, (want, got) in results.items():
        assert got.shape == want.shape and torch.isfinite(want).all(), name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_stage_buffers_view_padded_steps_as_contiguous_messages() -> None:
    middle = PipelineStage(1, 2, is_first=False, is_last=False)
    sb = StageBuffers(middle, 8, 6, torch.float32, torch.device("cpu"))
    assert StageBuffers.nbytes(middle, 8, 6, torch.float32) == 2 * 2 * 8 * 6 * 4
    assert StageBuffers.nbytes(PipelineStage(), 8, 6, torch.float32) == 0
    for n in (1, 5, 8):
        x, y = sb.input(n), sb.output(n)
        assert x.shape == y.shape == (2, n, 6) and x.is_contiguous() and y.is_contiguous()
    sb.output(5).copy_(torch.arange(60.0).view(2, 5, 6))
    assert torch.equal(sb.output(5)[1, 0], torch.arange(30.0, 36.0))  # residual after 5 rows
    with pytest.raises(ValueError, match="1 to 8 tokens, got 9"):
        sb.input(9)
    first = StageBuffers(PipelineStage(0, 1, is_first=True, is_last=False), 8, 6,
                         torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="first pipeline stage has no input"):
        first.input(1)
