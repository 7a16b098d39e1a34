"""CUDA graphs for decode-only steps: one graph per padded batch size, LM head included."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from peregrine.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from peregrine.worker.model_runner import ModelRunner

logger = logging.getLogger("peregrine")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class CudaGraphRunner:
    """Captures model + LM head over the runner's fixed device buffers; replays for padded batches."""

    def __init__(self, runner: ModelRunner) -> None:
        if runner.config.attention_backend != "triton":
            raise ValueError("CUDA graphs need attention_backend='triton' (the torch backend reads "
                             "host metadata); pass enforce_eager=True to run without graphs")
        self.runner = runner
        # NOTE: a decode batch of B sequences is B tokens, so B is capped by the token budget too.
        self.sizes = capture_sizes(min(runner.max_num_reqs, runner.max_num_tokens))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        t0 = time.perf_counter()
        self._capture_all()
        logger.info("captured %d CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs),
                    self.sizes, time.perf_counter() - t0)

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def padded(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def _meta(self, bs: int) -> AttentionMetadata:
        buf = self.runner.buffers
        return AttentionMetadata(
            num_actual_tokens=bs, num_decodes=bs, num_decode_tokens=bs, max_query_len=1,
            max_seq_len=self.runner.config.scheduler.max_model_len,
            query_start_loc=buf.d_query_start_loc[:bs + 1], seq_lens=buf.d_seq_lens[:bs],
            block_table=buf.d_block_table[:bs], slot_mapping=buf.d_slot_mapping[:bs])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        r, buf = self.runner, self.runner.buffers
        n = self.sizes[-1]
        buf.d_input_ids[:n].zero_()
        buf.d_positions[:n].zero_()
        buf.d_slot_mapping[:n].fill_(-1)
        buf.d_seq_lens[:n].fill_(1)
        buf.d_query_start_loc[:n + 1].copy_(torch.arange(n + 1, dtype=torch.int32))
        buf.d_block_table[:n].zero_()
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            meta = self._meta(bs)

            def fwd(bs=bs, meta=meta) -> torch.Tensor:
                hidden = r.model(buf.d_input_ids[:bs], buf.d_positions[:bs], r.kv_caches, meta)
                return r.model.compute_logits(hidden)  # (bs, V)

            fwd()  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[bs] = fwd()
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize()

    def replay(self, num_seqs: int) -> torch.Tensor:
        """Logits (B, V) of a decode-only step whose inputs are already in the device buffers."""
        bs = self.padded(num_seqs)
        self.graphs[bs].replay()
        return self.logits[bs][:num_seqs]
