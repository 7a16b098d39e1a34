"""Full CUDA graphs for speculative verify steps.

A verify step (every sequence 1 + d query tokens, d <= k drafts, no prefill chunk) at a small
batch is bound by the host: eager attention between piecewise graphs costs more than the device
time. These graphs hold the whole model and the LM head for B sequences (padded sizes 1, 2, 4,
8, ...) of up to k + 1 tokens, B (k + 1) token rows in all. The step's real tokens are packed
first, as the eager path packs them; the padding tokens after them belong to no sequence and
write no K/V (slot -1), padding sequences have no query tokens and length 0. Attention runs the
extend kernel over every sequence with a fixed grid (max_query_len = k + 1), reading the query
starts, lengths and block table from the fixed device buffers, so one graph fits any mix of
draft counts. The logits of every token row come back; the runner gathers the sampled ones.

NOTE: the padding tokens' attention rows are left unwritten (num_actual_tokens covers them, so
nothing host-sized is zeroed inside the graph); their values stay in their own rows, since every
other op is row-wise and they store no K/V, and their logits are never gathered.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from peregrine.attention.metadata import AttentionMetadata
from peregrine.worker.cuda_graphs import CudaGraphRunner, KVCaches, capture_sizes
from peregrine.worker.step_buffers import StepBuffers

logger = logging.getLogger("peregrine")


def verify_graph_batch(max_num_seqs: int, max_num_batched_tokens: int, k: int,
                       disable_by_batch_size: int | None) -> int:
    """The largest verify batch worth a graph: speculation stops above disable_by_batch_size,
    and B (k + 1) tokens must fit the step buffers."""
    b = min(max_num_seqs, max_num_batched_tokens // (k + 1))
    if disable_by_batch_size is not None:
        b = min(b, disable_by_batch_size)
    return b


def verify_graph_bytes(max_batch_size: int, k: int, vocab_size: int) -> int:
    """GPU memory the verify graphs keep for logits: the shared float32 buffer and one graph's
    LM-head matmul output before it is converted into that buffer (counted as float32, an upper
    bound; activations not counted)."""
    return max_batch_size * (k + 1) * vocab_size * 4 * 2


class VerifyGraphs(CudaGraphRunner):
    """Captures model + LM head for verify batches over the fixed step buffers; replays them.

    Every graph writes its logits into the first rows of one shared (max B (k + 1), V) buffer.
    Buffers, capture and warm-up are the decode graphs' (CudaGraphRunner) with k + 1 rows per
    sequence; the attention metadata and the replayed rows are its own. With capture=False the same steps run eagerly on the same buffers and metadata (the CPU
    tests' path), so the padding and the fixed metadata are what the CPU tests check.
    """

    def __init__(self, model: nn.Module, buffers: StepBuffers, kv_caches: KVCaches,
                 max_batch_size: int, num_speculative_tokens: int, max_model_len: int,
                 capture: bool = True, pool=None) -> None:
        if max_batch_size < 1 or num_speculative_tokens < 1:
            raise ValueError(f"verify graphs need a batch >= 1 and k >= 1, got "
                             f"{max_batch_size} and {num_speculative_tokens}")
        self.model = model
        self.buffers = buffers
        self.kv_caches = kv_caches
        self.query_len = num_speculative_tokens + 1
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch_size)
        if self.sizes[-1] * self.query_len > buffers.d_input_ids.shape[0]:
            raise ValueError(f"{self.sizes[-1]} verify rows of {self.query_len} tokens exceed "
                             f"the step buffers' {buffers.d_input_ids.shape[0]} tokens")
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # (max B (k + 1), V) float32, shared
        self.pool = pool
        if not capture:
            with torch.inference_mode():
                self._reset_buffers()
                self.logits = self._run(self.sizes[-1])
            return
        t0 = time.perf_counter()
        self._capture_all()
        logger.info("captured %d verify graphs (batch sizes %s, %d tokens each) in %.1f s",
                    len(self.graphs), self.sizes, self.query_len, time.perf_counter() - t0)

    def can_run(self, num_seqs: int, num_tokens: int) -> bool:
        """Whether a verify step of num_seqs sequences and num_tokens tokens fits a graph."""
        return num_seqs <= self.sizes[-1] and num_tokens <= num_seqs * self.query_len

    def num_tokens(self, padded_seqs: int) -> int:
        """Token rows of the graph for padded_seqs sequences."""
        return padded_seqs * self.query_len

    def _meta(self, bs: int) -> AttentionMetadata:
        buf, t = self.buffers, bs * self.query_len
        # NOTE: num_decodes 0: every sequence goes through the extend kernel, whose grid depends
        # only on (max_query_len, heads, bs); num_actual_tokens t: no host-sized zeroing.
        return AttentionMetadata(
            num_actual_tokens=t, num_decodes=0, max_query_len=self.query_len,
            max_seq_len=self.max_model_len,
            query_start_loc=buf.d_query_start_loc[:bs + 1], seq_lens=buf.d_seq_lens[:bs],
            block_table=buf.d_block_table[:bs], slot_mapping=buf.d_slot_mapping[:t])

    def replay(self, padded_seqs: int) -> torch.Tensor:
        """Logits (B (k + 1), V) of the verify step whose inputs are in the device buffers,
        padded to padded_seqs sequences: a view of the shared buffer, valid until the next
        replay."""
        if self.graphs:
            self.graphs[padded_seqs].replay()
        else:
            self._run(padded_seqs)
        return self.logits[:padded_seqs * self.query_len]
