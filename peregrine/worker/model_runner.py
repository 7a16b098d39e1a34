"""ModelRunner: turns a SchedulerOutput into one flat forward pass, samples, and returns token ids."""
from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from peregrine.attention import get_attention_backend
from peregrine.attention.metadata import AttentionMetadata
from peregrine.config import EngineConfig
from peregrine.engine.request import Request
from peregrine.engine.scheduler import SchedulerOutput
from peregrine.sample.logprobs import compute_token_logprobs
from peregrine.sample.metadata import build_sampling_metadata
from peregrine.sample.sampler import Sampler
from peregrine.worker.input_batch import BlockTableRows, StepBuffers
from peregrine.worker.kv_memory import allocate_kv_caches, determine_num_blocks
from peregrine.worker.loader import load_model, set_fused_kernels

logger = logging.getLogger("peregrine")


@dataclass
class TokenLogprobs:
    """Top-N logprobs of consecutive positions: ids[i][0] is the chosen token, ids[i][1:] the top-N."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: list[list[int]]  # parallel to SchedulerOutput.scheduled_requests
    logprobs: dict[str, TokenLogprobs]  # request id -> logprobs of this step's sampled token
    prompt_logprobs: dict[str, TokenLogprobs]  # request id -> logprobs of this chunk's prompt tokens


class ModelRunner:
    """Owns the model, the KV cache pool and the preallocated step buffers on one device."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.device = torch.device(config.device)
        self.dtype = mc.dtype
        self.block_size = config.cache.block_size
        self.vocab_size = mc.vocab_size
        self.backend = get_attention_backend(config.attention_backend)
        self.model = load_model(mc, self.backend, self.device)
        if self.device.type == "cuda" and os.environ.get("PEREGRINE_FUSED_KERNELS", "1") != "0":
            set_fused_kernels(self.model, True)
        sc = config.scheduler
        self.max_num_tokens = sc.max_num_batched_tokens
        self.max_num_reqs = sc.max_num_seqs
        self.max_blocks_per_req = -(-sc.max_model_len // self.block_size)
        self.rows = BlockTableRows(self.max_num_reqs, self.max_blocks_per_req)
        self.buffers = StepBuffers(self.max_num_tokens, self.max_num_reqs, self.max_blocks_per_req,
                                   self.device)
        self.sampler = Sampler()
        self.num_blocks = determine_num_blocks(self, config)
        self.kv_caches = allocate_kv_caches(mc, self.num_blocks, self.block_size, self.device)
        self.graphs = None
        self.timing: dict[str, float] = defaultdict(float)
        if self.device.type == "cuda" and not config.enforce_eager and \
                config.attention_backend == "triton":
            from peregrine.worker.cuda_graphs import CudaGraphRunner
            self.graphs = CudaGraphRunner(self)

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_request_ids:
            self.rows.release(rid)
        for rid in out.preempted_request_ids:
            self.rows.release(rid)
        reqs = out.scheduled_requests
        if not reqs:
            return ModelRunnerOutput([], {}, {})
        # NOTE: decodes (query length 1) go first: the attention backend splits the batch there.
        t0 = time.perf_counter()
        order = sorted(range(len(reqs)), key=lambda i: out.num_scheduled_tokens[i] != 1)
        batch = [reqs[i] for i in order]
        q_lens = np.fromiter((out.num_scheduled_tokens[i] for i in order), np.int64, len(order))
        step = self._prepare(batch, q_lens)
        t1 = time.perf_counter()
        hidden, logits = self._forward(step)
        t2 = time.perf_counter()
        result = self._sample(batch, order, q_lens, step, hidden, logits)
        t3 = time.perf_counter()
        # Host seconds per phase; "sample" includes waiting for the GPU at the step's one sync.
        tm = self.timing
        tm["prepare"] += t1 - t0
        tm["forward_launch"] += t2 - t1
        tm["sample_and_sync"] += t3 - t2
        tm["steps"] += 1
        tm["decode_only_steps"] += step.num_decodes == step.num_seqs
        return result

    def _prepare(self, batch: list[Request], q_lens: np.ndarray) -> _Step:
        buf = self.buffers
        b = len(batch)
        num_computed = np.fromiter((r.num_computed_tokens for r in batch), np.int64, b)  # (B,)
        seq_lens = num_computed + q_lens  # (B,)
        qsl = np.zeros(b + 1, np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        t = int(qsl[-1])
        num_decodes = int(np.searchsorted(q_lens != 1, True)) if b else 0
        # Token ids: decodes take one token each, prefill chunks a slice of the request's tokens.
        ids = buf.input_ids_np
        if num_decodes:
            ids[:num_decodes] = [r.all_token_ids[r.num_computed_tokens] for r in batch[:num_decodes]]
        for i in range(num_decodes, b):
            r = batch[i]
            start = r.num_computed_tokens
            ids[qsl[i]:qsl[i + 1]] = r.all_token_ids[start:start + int(q_lens[i])]
        rows = np.fromiter((self.rows.sync(r) for r in batch), np.int64, b)  # (B,)
        positions = np.arange(t, dtype=np.int64) - np.repeat(qsl[:-1] - num_computed, q_lens)  # (T,)
        tok_rows = np.repeat(rows, q_lens)  # (T,)
        blocks = self.rows.table[tok_rows, positions // self.block_size]  # (T,)
        buf.positions_np[:t] = positions
        buf.slot_mapping_np[:t] = blocks * self.block_size + positions % self.block_size
        width = int(self.rows.num_blocks[rows].max())
        buf.block_table_np[:b, :width] = self.rows.table[rows, :width]
        buf.seq_lens_np[:b] = seq_lens
        buf.query_start_loc_np[:b + 1] = qsl
        return _Step(t, b, num_decodes, int(q_lens.max()), int(seq_lens.max()), width, qsl, seq_lens)

    def _forward(self, step: _Step) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(hidden (T, hidden), None) eagerly, or (None, logits (B, V)) from a CUDA graph."""
        if self.graphs is not None and step.num_decodes == step.num_seqs and \
                self.graphs.can_run(step.num_seqs):
            return None, self.graphs.run(step)
        buf = self.buffers
        t, b = step.num_tokens, step.num_seqs
        input_ids, positions, meta = buf.to_device(t, b, step.width)
        meta.num_decodes = meta.num_decode_tokens = step.num_decodes
        meta.max_query_len = step.max_query_len
        meta.max_seq_len = step.max_seq_len
        return self.model(input_ids, positions, self.kv_caches, meta), None

    def _sample(self, batch: list[Request], order: list[int], q_lens: np.ndarray, step: _Step,
                hidden: torch.Tensor | None, all_logits: torch.Tensor | None) -> ModelRunnerOutput:
        sample_pos: list[int] = []  # batch index of each request that samples this step
        prompt_lp: list[tuple[int, int, int]] = []  # (batch idx, first prompt position, count)
        for i, r in enumerate(batch):
            start, n = r.num_computed_tokens, int(q_lens[i])
            if r.sampling_params.prompt_logprobs is not None and start < r.num_prompt_tokens - 1:
                prompt_lp.append((i, start, min(start + n, r.num_prompt_tokens - 1) - start))
            if start + n >= r.num_tokens:
                sample_pos.append(i)
        logits_idx = [int(step.qsl[i + 1]) - 1 for i in sample_pos]
        prompt_idx: list[int] = []
        for i, _, count in prompt_lp:
            first = int(step.qsl[i])
            prompt_idx.extend(range(first, first + count))
        idx = torch.tensor(logits_idx + prompt_idx, dtype=torch.long).to(self.device, non_blocking=True)
        if all_logits is not None:  # decode-only graph step: one row per sequence
            logits = all_logits.index_select(0, idx)  # (S + P, V)
        else:
            logits = self.model.compute_logits(hidden.index_select(0, idx))  # (S + P, V)
        sampled_reqs = [batch[i] for i in sample_pos]
        sampled_lists: list[list[int]] = [[] for _ in batch]
        logprobs: dict[str, TokenLogprobs] = {}
        if sampled_reqs:
            meta = build_sampling_metadata(sampled_reqs, self.vocab_size, self.device)
            so = self.sampler(logits[: len(sampled_reqs)], meta)
            tokens = so.sampled_token_ids.tolist()  # the step's one device->host sync
            for i, tok in zip(sample_pos, tokens):
                sampled_lists[i] = [tok]
            if so.logprobs is not None:
                ids, lps, ranks = so.logprob_token_ids.tolist(), so.logprobs.tolist(), so.ranks.tolist()
                for j, r in enumerate(sampled_reqs):
                    k = r.sampling_params.logprobs
                    if k is not None:
                        logprobs[r.request_id] = TokenLogprobs([ids[j][: k + 1]], [lps[j][: k + 1]], [ranks[j]])
        prompt_logprobs = self._prompt_logprobs(batch, prompt_lp, logits[len(sampled_reqs):])
        # Back to the scheduler's order.
        inverse = [0] * len(order)
        for pos, i in enumerate(order):
            inverse[i] = pos
        return ModelRunnerOutput([sampled_lists[inverse[i]] for i in range(len(order))], logprobs,
                                 prompt_logprobs)

    def _prompt_logprobs(self, batch: list[Request], spans: list[tuple[int, int, int]],
                         logits: torch.Tensor) -> dict[str, TokenLogprobs]:
        result: dict[str, TokenLogprobs] = {}
        if not spans:
            return result
        targets: list[int] = []
        for i, first, count in spans:
            targets.extend(batch[i].prompt_token_ids[first + 1:first + 1 + count])
        k = max(batch[i].sampling_params.prompt_logprobs for i, _, _ in spans)
        tgt = torch.tensor(targets, dtype=torch.long, device=self.device)
        ids, lps, ranks = compute_token_logprobs(logits, tgt, k)
        ids, lps, ranks = ids.tolist(), lps.tolist(), ranks.tolist()
        off = 0
        for i, _, count in spans:
            r = batch[i]
            kk = r.sampling_params.prompt_logprobs + 1
            result[r.request_id] = TokenLogprobs([x[:kk] for x in ids[off:off + count]],
                                                 [x[:kk] for x in lps[off:off + count]],
                                                 ranks[off:off + count])
            off += count
        return result


@dataclass
class _Step:
    num_tokens: int
    num_seqs: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    width: int  # block-table columns in use
    qsl: np.ndarray  # (B + 1,) query start offsets
    seq_lens: np.ndarray  # (B,)


def build_attention_metadata(t: int, b: int, num_decodes: int, max_query_len: int,
                             max_seq_len: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                             block_table: torch.Tensor, slot_mapping: torch.Tensor,
                             qsl_cpu: torch.Tensor | None, seq_lens_cpu: torch.Tensor | None
                             ) -> AttentionMetadata:
    return AttentionMetadata(
        num_actual_tokens=t, num_decodes=num_decodes, num_decode_tokens=num_decodes,
        max_query_len=max_query_len, max_seq_len=max_seq_len, query_start_loc=query_start_loc,
        seq_lens=seq_lens, block_table=block_table, slot_mapping=slot_mapping,
        query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu)
