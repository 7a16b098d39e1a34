"""A model run whole and as pipeline stages through the graph runners, in one process (tests):
CUDA graphs on a GPU (capture=True), their eager form over the same fixed buffers elsewhere. A
stage's padded step goes from its output buffer into the next stage's input buffer by a copy,
where the engine sends it between processes."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from peregrine.attention import get_attention_backend
from peregrine.config import EngineArgs
from peregrine.models.protocol import PipelineStage
from peregrine.worker.cuda_graphs import CudaGraphRunner, PiecewiseGraphs
from peregrine.worker.loader import load_model
from peregrine.worker.step_buffers import StageBuffers, StepBuffers

BLOCK_SIZE, NUM_BLOCKS, WIDTH = 4, 16, 4  # 4 blocks of 4 tokens per sequence
MAX_TOKENS, MAX_SEQS = 16, 4
PIECE_SIZES = [8, 16]


class _Part:
    """One model (whole, or one stage) with its own caches, step buffers and graph runners."""

    def __init__(self, path: str, device: torch.device, stage: PipelineStage | None,
                 capture: bool) -> None:
        cfg = EngineArgs(model=path, dtype="float32", device=str(device)).create_engine_config()
        mc = cfg.model
        self.model = load_model(mc, get_attention_backend("triton"), device, stage=stage)
        shape = (NUM_BLOCKS, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim)
        self.caches = [(torch.zeros(shape, dtype=mc.dtype, device=device),
                        torch.zeros(shape, dtype=mc.dtype, device=device))
                       for _ in self.model.layers]
        self.buffers = StepBuffers(MAX_TOKENS, MAX_SEQS, WIDTH, device)
        self.stage_buffers = None if stage is None else StageBuffers(
            stage, MAX_TOKENS, mc.hidden_size, mc.dtype, device)
        self.graphs = CudaGraphRunner(self.model, self.buffers, self.caches, MAX_SEQS, 64,
                                      capture=capture, stage_buffers=self.stage_buffers)
        self.pieces = PiecewiseGraphs(self.model, self.buffers, self.caches, PIECE_SIZES,
                                      capture=capture, pool=self.graphs.pool,
                                      stage_buffers=self.stage_buffers)

    def feed(self, prev: torch.Tensor | None) -> None:
        """The previous stage's padded (2, n, hidden) into this stage's input buffer."""
        if prev is not None:
            self.stage_buffers.input(prev.shape[1]).copy_(prev)

    def prefill(self, ids: Sequence[int], prev: torch.Tensor | None) -> torch.Tensor:
        """One sequence's whole prompt (blocks 0..) through the piecewise runner."""
        buf, t = self.buffers, len(ids)
        buf.input_ids_np[:t] = ids
        buf.positions_np[:t] = np.arange(t)
        buf.slot_mapping_np[:t] = np.arange(t)
        buf.seq_lens_np[:1] = t
        buf.query_start_loc_np[:2] = (0, t)
        buf.block_table_np[0, :WIDTH] = np.arange(WIDTH)
        _, _, meta = buf.to_device(t, 1, WIDTH, pad_t=self.pieces.padded(t))
        meta.num_decodes, meta.max_query_len, meta.max_seq_len = 0, t, t
        self.feed(prev)
        return self.pieces.run(t, meta).clone()

    def decode(self, ids: Sequence[int], positions: Sequence[int],
               prev: torch.Tensor | None) -> torch.Tensor:
        """A decode step of len(ids) sequences (sequence i in blocks 4 i ..) through the decode
        graphs' runner."""
        buf, b = self.buffers, len(ids)
        pos = np.asarray(positions)
        buf.input_ids_np[:b] = ids
        buf.positions_np[:b] = pos
        blocks = np.arange(b)[:, None] * WIDTH + np.arange(WIDTH)[None, :]  # (b, WIDTH)
        buf.block_table_np[:b, :WIDTH] = blocks
        buf.slot_mapping_np[:b] = blocks[np.arange(b), pos // BLOCK_SIZE] * BLOCK_SIZE \
            + pos % BLOCK_SIZE
        buf.seq_lens_np[:b] = pos + 1
        buf.query_start_loc_np[:b + 1] = np.arange(b + 1)
        pad = self.graphs.padded(b)
        buf.to_device(b, b, WIDTH, pad_t=pad, pad_b=pad)
        self.feed(prev)
        return self.graphs.replay(b).clone()


@torch.inference_mode()
def whole_and_staged(path: str, device: torch.device, partition: Sequence[int],
                     capture: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{"prefill": (whole, staged) final hidden states (10, hidden) of a 10-token prompt
    through the piecewise runners, "decode": (whole, staged) logits (3, V) of a decode step of
    that sequence and two one-token ones through the decode runners}; the stages of
    `partition` (layers per stage) run one after another, each from the last one's output."""
    prompt, dec_ids, dec_pos = [5, 9, 2, 33, 17, 8, 41, 3, 12, 27], [7, 11, 13], [10, 0, 0]
    whole = _Part(path, device, None, capture)
    parts = [_Part(path, device, PipelineStage.of(partition, r), capture)
             for r in range(len(partition))]
    want_p = whole.prefill(prompt, None)
    want_d = whole.decode(dec_ids, dec_pos, None)
    out = None
    for part in parts:
        out = part.prefill(prompt, out)
    got_p = out
    out = None
    for part in parts:
        out = part.decode(dec_ids, dec_pos, out)
    return {"prefill": (want_p, got_p), "decode": (want_d, out)}
