"""CUDA graphs.

- Decode-only steps: one graph per padded batch size, the whole model and the LM head included.
- Mixed and prefill steps (piecewise): per padded token count, one graph per stretch between two
  attention calls; attention runs eagerly in between with the step's host metadata, so any mix of
  decodes, chunks and cached prefixes fits. This removes the eager per-kernel launch cost, which
  for small chunks (a prefix-cache hit) is larger than the GPU time itself.
- Pipeline stages capture both kinds over their own layers: a stage after the first starts from
  the previous stage's (hidden, residual) in a fixed buffer, a stage before the last ends by
  writing its own into another (step_buffers.StageBuffers) instead of the norm and LM head; the
  messages between stages carry the padded step.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from peregrine.attention.metadata import AttentionMetadata
from peregrine.models.protocol import PipelineStage, final_norm, stage_output
from peregrine.worker.step_buffers import StageBuffers, StepBuffers

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

logger = logging.getLogger("peregrine")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def decode_graph_bytes(max_batch_size: int, vocab_size: int, dtype: torch.dtype) -> int:
    """GPU memory the decode graphs keep for logits, from shapes (activations not counted)."""
    n, v = max_batch_size, vocab_size
    # NOTE: the shared float32 buffer (the largest graph's output, which the other graphs'
    # LM heads write into) and the LM head's matmul output in the model's dtype; the
    # temporaries of every graph alias each other in the one memory pool.
    return n * v * 4 + n * v * dtype.itemsize


class CudaGraphRunner:
    """Captures model + LM head over fixed device step buffers; replays for padded batches.

    Every graph writes its logits into the first rows of one shared (max size, V) buffer, and
    all graphs share one memory pool, captured largest first, so their temporaries alias.

    With capture=False the same steps run eagerly on the same buffers (the CPU path tests use).
    Each sequence has query_len token rows (1 here; verify_graphs.py's subclass has k + 1).
    A pipeline stage before the last (stage_buffers) has no logits: its graphs end in the
    stage's fixed output buffer.
    """

    query_len = 1
    # the whole model unless built for a pipeline stage (subclasses without stages keep these)
    stage_buffers: StageBuffers | None = None
    stage = PipelineStage()

    def __init__(self, model: nn.Module, buffers: StepBuffers, kv_caches: KVCaches,
                 max_batch_size: int, max_model_len: int, capture: bool = True,
                 stage_buffers: StageBuffers | None = None) -> None:
        """max_batch_size: the largest decode batch (at most max_num_seqs and the token budget)."""
        self.model = model
        self.buffers = buffers
        self.stage_buffers = stage_buffers
        self.stage = stage_buffers.stage if stage_buffers is not None else PipelineStage()
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # (max size, V) float32, shared by every graph
        self.pool = None
        self.memory_bytes = 0  # GPU memory the captured graphs keep (pool and logits buffer)
        if not capture:
            with torch.inference_mode():
                self._reset_buffers()
                out = self._run(self.sizes[-1])
                if self.stage.is_last:
                    self.logits = out
            return
        dev = buffers.d_input_ids.device
        t0 = time.perf_counter()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(dev)
        self._capture_all()
        # NOTE: empty_cache drops the warm-ups' blocks; the graphs' pool stays while they live.
        torch.cuda.empty_cache()
        self.memory_bytes = torch.cuda.memory_reserved(dev) - reserved
        logger.info("captured %d CUDA graphs (batch sizes %s) in %.1f s, %.2f GiB",
                    len(self.graphs), self.sizes, time.perf_counter() - t0,
                    self.memory_bytes / 2**30)

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def padded(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def _meta(self, bs: int) -> AttentionMetadata:
        buf = self.buffers
        return AttentionMetadata(
            num_actual_tokens=bs, num_decodes=bs, max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=buf.d_query_start_loc[:bs + 1], seq_lens=buf.d_seq_lens[:bs],
            block_table=buf.d_block_table[:bs], slot_mapping=buf.d_slot_mapping[:bs])

    def _reset_buffers(self) -> None:
        """A harmless batch of the largest size: ids 0, query_len tokens per sequence and as
        long, no K/V written."""
        buf, n, q = self.buffers, self.sizes[-1], self.query_len
        buf.d_input_ids[:n * q].zero_()
        buf.d_positions[:n * q].zero_()
        buf.d_slot_mapping[:n * q].fill_(-1)
        buf.d_seq_lens[:n].fill_(q)
        buf.d_query_start_loc[:n + 1].copy_(torch.arange(0, n * q + 1, q, dtype=torch.int32))
        buf.d_block_table[:n].zero_()

    def _run(self, bs: int) -> torch.Tensor:
        """Logits (bs query_len, V) of the first bs sequences' rows of the step buffers: rows of
        the shared buffer once it exists, else a fresh tensor (the largest size's, which becomes
        it). A stage before the last: its (2, t, hidden) output buffer, written."""
        buf, t, sb = self.buffers, bs * self.query_len, self.stage_buffers
        args = (buf.d_input_ids[:t], buf.d_positions[:t], self.kv_caches, self._meta(bs))
        # (t, hidden); (2, t, hidden) on a stage before the last
        hidden = self.model(*args) if self.stage.is_first else self.model(*args, sb.input(t))
        if not self.stage.is_last:
            return sb.output(t).copy_(hidden)
        if self.logits is None:
            return self.model.compute_logits(hidden)  # (t, V) float32
        return self.model.compute_logits(hidden, out=self.logits[:t])  # (t, V)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self._reset_buffers()
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            self._run(bs)  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self._run(bs)  # (bs query_len, V)
            if self.logits is None and self.stage.is_last:
                # NOTE: the largest graph's own output is the shared buffer; holding it keeps
                # its block out of the pool, so no later graph's temporaries can alias it.
                self.logits = out
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize()

    def replay(self, num_seqs: int) -> torch.Tensor:
        """Logits (B, V) of a decode-only step whose inputs are already in the device buffers
        (a stage after the first: its input buffer too).

        A view of the shared buffer: the next replay (of any size) overwrites it, so it must be
        consumed by work queued on the same stream before that replay is launched. A stage
        before the last: its output buffer's (2, padded(B), hidden), under the same rule."""
        bs = self.padded(num_seqs)
        if self.graphs:
            self.graphs[bs].replay()
        else:
            self._run(bs)
        if not self.stage.is_last:
            return self.stage_buffers.output(bs * self.query_len)
        return self.logits[:num_seqs]


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """Padded token counts for piecewise graphs: fine steps for small counts, coarser beyond.

    Past 2,048 tokens the steps widen (512, then 1,024 tokens: at most 25% padding). Padding
    costs less than running such a step eagerly: its hundreds of launches from Python took ~18 ms
    of host time for Qwen3-0.6B on an H200, as long as the GPU needs for 8,192 tokens.
    """
    if max_tokens <= 0:
        return []
    sizes = [8, 16, 24, 32, 48, 64, 80, 96, 112, 128]
    sizes += list(range(160, 513, 32)) + list(range(576, 1025, 64))
    sizes += list(range(1152, 2049, 128)) + list(range(2560, 4097, 512))
    sizes += list(range(5120, max(5121, max_tokens + 1), 1024))
    sizes = [s for s in sizes if s < max_tokens]
    return sorted(set(sizes + [max_tokens]))


class PiecewiseGraphs:
    """Steps of up to max(sizes) tokens: piece 0 is the embedding and layer 0 up to storing its
    K/V, piece i (1..L-1) runs layer i-1 after attention and layer i up to storing its K/V,
    piece L the last layer after attention and the final norm. Pieces talk through fixed
    buffers (q, attention output, residual, hidden), so a replay needs only the step's input
    buffers (ids, positions, slot mapping).

    With capture=False the pieces run eagerly on the same buffers and padding (the CPU path
    tests use, where CUDA graphs do not exist).

    pool: a memory pool to capture into (the decode graphs'): every piece's temporaries are dead
    once it ends, and no two graphs ever run at once on the one stream, so they may alias.

    A pipeline stage (stage_buffers): piece 0 of a stage after the first starts from the
    previous stage's (hidden, residual) in its input buffer; the last piece of a stage before
    the last writes its own into its output buffer instead of the final norm.
    """

    def __init__(self, model: nn.Module, buffers: StepBuffers, kv_caches: KVCaches,
                 sizes: list[int], capture: bool = True,
                 pool: tuple[int, int] | None = None,
                 stage_buffers: StageBuffers | None = None) -> None:
        if not sizes:
            raise ValueError("PiecewiseGraphs needs at least one size")
        self.model = model
        self.buffers = buffers
        self.kv_caches = kv_caches
        self.stage_buffers = stage_buffers
        self.stage = stage_buffers.stage if stage_buffers is not None else PipelineStage()
        self.layers = list(self.model.layers)
        self.sizes = sorted(sizes)
        n = self.sizes[-1]
        if stage_buffers is not None and stage_buffers.max_tokens < n:
            raise ValueError(f"the stage buffers hold {stage_buffers.max_tokens} tokens, the "
                             f"piecewise graphs up to {n}")
        attn = self.layers[0].self_attn
        if self.stage.is_first:
            emb = self.model.embed_tokens.weight
            dev, dt, hidden = emb.device, emb.dtype, emb.shape[1]
        else:
            sb = stage_buffers
            dev, dt, hidden = sb.device, sb.dtype, sb.hidden
        self.q = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dt, device=dev)
        self.o = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dt, device=dev)
        self.residual = torch.zeros(n, hidden, dtype=dt, device=dev)
        self.hidden = torch.zeros(n, hidden, dtype=dt, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = pool
        if capture:
            t0 = time.perf_counter()
            self._capture_all()
            logger.info("captured piecewise CUDA graphs for %d token counts up to %d (%d graphs) "
                        "in %.1f s", len(self.sizes), n, sum(map(len, self.graphs.values())),
                        time.perf_counter() - t0)

    def can_run(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def padded(self, num_tokens: int) -> int:
        return next(s for s in self.sizes if s >= num_tokens)

    def _piece(self, i: int, n: int) -> None:
        """Piece i over the first n (padded) tokens of the step buffers."""
        buf = self.buffers
        if i == 0 and self.stage.is_first:
            x, residual = self.model.embed_tokens(buf.d_input_ids[:n]), None  # (n, hidden)
        elif i == 0:
            x, residual = self.stage_buffers.input(n)  # (n, hidden) each
        else:
            x, residual = self.layers[i - 1].post_attention(self.o[:n].view(n, -1),
                                                            self.residual[:n])
        if i == len(self.layers) and not self.stage.is_last:
            stage_output(x, residual, self.stage_buffers.output(n))  # (2, n, hidden)
            return
        if i == len(self.layers):
            self.hidden[:n].copy_(final_norm(self.model.norm, x, residual))
            return
        # NOTE: K/V go to the cache inside the graph (padding slots are -1): the eager part
        # between pieces is the attention kernels alone. q and the residual are written straight
        # into the fixed buffers the next piece reads (no copies with fused kernels).
        self.layers[i].pre_attention(buf.d_positions[:n], x, residual, self.kv_caches[i],
                                     buf.d_slot_mapping[:n], out=(self.q[:n], self.residual[:n]))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # NOTE: warm-up runs store K/V: with every slot -1 they write nothing.
        self.buffers.d_slot_mapping[:self.sizes[-1]].fill_(-1)
        for n in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            for i in range(len(self.layers) + 1):
                self._piece(i, n)  # warm-up: Triton compiles, cuBLAS picks, outside the capture
            torch.cuda.synchronize()
            graphs = []
            for i in range(len(self.layers) + 1):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self._piece(i, n)
                if self.pool is None:
                    self.pool = g.pool()
                graphs.append(g)
            self.graphs[n] = graphs
        torch.cuda.synchronize()

    def run(self, num_tokens: int, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states (num_tokens, hidden) of a step whose inputs are in the step buffers,
        padded to padded(num_tokens) (padding slots are -1 in meta.slot_mapping). A stage before
        the last: its output buffer's (2, padded(num_tokens), hidden), the whole padded step
        (a stage after the first reads its input buffer the same way)."""
        n = self.padded(num_tokens)
        if meta.slot_mapping.shape[0] != n or \
                meta.slot_mapping.data_ptr() != self.buffers.d_slot_mapping.data_ptr():
            raise ValueError(f"slot_mapping must be the step buffer's first {n} (padded) rows")
        graphs = self.graphs.get(n)
        kv = self.kv_caches
        # NOTE: attention writes only the step's rows of the shared output buffer: its padding
        # rows, zeroed once here, stay zero through every layer (one launch, not one per layer).
        self.o[meta.num_actual_tokens:n].zero_()
        meta.out_padding_zeroed = True
        for i, layer in enumerate(self.layers):
            if graphs is None:
                self._piece(i, n)
            else:
                graphs[i].replay()
            layer.self_attn.attn(self.q[:n], None, None, kv[i], meta, out=self.o[:n])
        meta.out_padding_zeroed = False  # other callers of this step's metadata own their output
        if graphs is None:
            self._piece(len(self.layers), n)
        else:
            graphs[-1].replay()
        if not self.stage.is_last:
            return self.stage_buffers.output(n)
        return self.hidden[:num_tokens]
