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
        self.prefill_graphs = None
        # Async scheduling: the previous step's sampled tokens (device) and each request's row.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        self._inputs_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self.timing: dict[str, float] = defaultdict(float)
        if self.device.type == "cuda" and config.attention_backend == "triton":
            from peregrine.kernels.decode_attention import precompile
            attn = self.model.layers[0].self_attn
            precompile(attn.num_heads, attn.num_kv_heads, attn.head_dim, self.block_size,
                       self.kv_caches[0][0].dtype, self.device)
        if self.device.type == "cuda" and not config.enforce_eager and \
                config.attention_backend == "triton":
            from peregrine.worker.cuda_graphs import (CudaGraphRunner, PiecewiseGraphs,
                                                      prefill_graph_sizes)
            free_before = torch.cuda.mem_get_info(self.device)[0]
            self.graphs = CudaGraphRunner(self)
            sizes = prefill_graph_sizes(config.max_prefill_graph_tokens)
            if sizes:
                self.prefill_graphs = PiecewiseGraphs(self, sizes)
            # NOTE: graph memory comes out of the (1 - gpu_memory_utilization) slack; say how much.
            logger.info("CUDA graphs use %.2f GiB of GPU memory",
                        (free_before - torch.cuda.mem_get_info(self.device)[0]) / 2**30)
        if self.device.type == "cuda":
            # Compile the sampling kernel now, not inside the first (timed) steps.
            self.sampler.warm_up(self.vocab_size, self.device)

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> StepHandle:
        """Queue one step's forward pass and sampling on the device; return without waiting.

        Decodes whose input token was sampled by the previous, still running step read it from
        that step's device tensor (async scheduling); everything else comes from the host.
        """
        for rid in out.finished_request_ids:
            self.rows.release(rid)
        for rid in out.preempted_request_ids:
            self.rows.release(rid)
        reqs = out.scheduled_requests
        if not reqs:
            return StepHandle(out, [], [], [], {}, None)
        t0 = time.perf_counter()
        # NOTE: decodes (query length 1) go first: the attention backend splits the batch there.
        order = sorted(range(len(reqs)), key=lambda i: out.num_scheduled_tokens[i] != 1)
        batch = [reqs[i] for i in order]
        starts = np.fromiter((out.num_computed_tokens[i] for i in order), np.int64, len(order))
        q_lens = np.fromiter((out.num_scheduled_tokens[i] for i in order), np.int64, len(order))
        step = self._prepare(batch, starts, q_lens)
        t1 = time.perf_counter()
        hidden, all_logits = self._forward(step)
        t2 = time.perf_counter()
        handle = self._launch_sampling(out, batch, order, starts, q_lens, step, hidden, all_logits)
        tm = self.timing
        tm["prepare"] += t1 - t0
        tm["forward_launch"] += t2 - t1
        tm["sample_launch"] += time.perf_counter() - t2
        tm["steps"] += 1
        tm["decode_only_steps"] += step.num_decodes == step.num_seqs
        return handle

    def _prepare(self, batch: list[Request], starts: np.ndarray, q_lens: np.ndarray) -> _Step:
        buf = self.buffers
        if self._inputs_copied is not None:
            # The previous step's host->device copies must be done before the buffers are reused.
            self._inputs_copied.synchronize()
        b = len(batch)
        seq_lens = starts + q_lens  # (B,)
        qsl = np.zeros(b + 1, np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        t = int(qsl[-1])
        num_decodes = int(np.searchsorted(q_lens != 1, True)) if b else 0
        # Token ids: decodes take one token each, prefill chunks a slice of the request's tokens.
        ids = buf.input_ids_np
        pending_dst: list[int] = []  # batch rows whose input is the previous step's sample
        if num_decodes:
            known = [r.all_token_ids[s] if s < r.num_tokens else -1
                     for r, s in zip(batch[:num_decodes], starts[:num_decodes].tolist())]
            ids[:num_decodes] = known
            if self._prev_sampled is not None:
                pending_dst = [i for i, tok in enumerate(known) if tok < 0]
        for i in range(num_decodes, b):
            r = batch[i]
            start = int(starts[i])
            ids[qsl[i]:qsl[i + 1]] = r.all_token_ids[start:start + int(q_lens[i])]
        rows = np.fromiter((self.rows.sync(r) for r in batch), np.int64, b)  # (B,)
        positions = np.arange(t, dtype=np.int64) - np.repeat(qsl[:-1] - starts, q_lens)  # (T,)
        tok_rows = np.repeat(rows, q_lens)  # (T,)
        blocks = self.rows.table[tok_rows, positions // self.block_size]  # (T,)
        buf.positions_np[:t] = positions
        buf.slot_mapping_np[:t] = blocks * self.block_size + positions % self.block_size
        width = int(self.rows.num_blocks[rows].max())
        buf.block_table_np[:b, :width] = self.rows.table[rows, :width]
        buf.seq_lens_np[:b] = seq_lens
        buf.query_start_loc_np[:b + 1] = qsl
        pending_src = [self._prev_rows[batch[i].request_id] for i in pending_dst]
        return _Step(t, b, num_decodes, int(q_lens.max()), int(seq_lens.max()), width, qsl,
                     pending_dst, pending_src)

    def _forward(self, step: _Step) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(hidden (T, hidden), None) eagerly, or (None, logits (B, V)) from a CUDA graph."""
        buf = self.buffers
        t, b = step.num_tokens, step.num_seqs
        graph = (self.graphs is not None and step.num_decodes == b and self.graphs.can_run(b))
        pad = self.graphs.padded(b) if graph else None
        pieces = (not graph and self.prefill_graphs is not None
                  and self.prefill_graphs.can_run(t))
        pad_t = self.prefill_graphs.padded(t) if pieces else pad
        input_ids, positions, meta = buf.to_device(t, b, step.width, pad_t=pad_t, pad_b=pad)
        if step.pending_dst:
            # In-flight samples of the previous step become this step's input ids, on the device.
            dst = self._h2d(step.pending_dst)
            src = self._h2d(step.pending_src)
            buf.d_input_ids.index_copy_(0, dst, self._prev_sampled.index_select(0, src))
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        if graph:
            return None, self.graphs.replay(b)
        meta.num_decodes = meta.num_decode_tokens = step.num_decodes
        meta.max_query_len = step.max_query_len
        meta.max_seq_len = step.max_seq_len
        if pieces:
            return self.prefill_graphs.run(t, meta), None
        return self.model(input_ids, positions, self.kv_caches, meta), None

    def _launch_sampling(self, out: SchedulerOutput, batch: list[Request], order: list[int],
                         starts: np.ndarray, q_lens: np.ndarray, step: _Step,
                         hidden: torch.Tensor | None, all_logits: torch.Tensor | None) -> StepHandle:
        sample_pos: list[int] = []  # batch index of each request that samples this step
        prompt_lp: list[tuple[int, int, int]] = []  # (batch idx, first prompt position, count)
        for i, r in enumerate(batch):
            start, n = int(starts[i]), int(q_lens[i])
            if r.sampling_params.prompt_logprobs is not None and start < r.num_prompt_tokens - 1:
                prompt_lp.append((i, start, min(start + n, r.num_prompt_tokens - 1) - start))
            if start + n >= r.num_tokens + r.num_output_placeholders:
                sample_pos.append(i)
        logits_idx = [int(step.qsl[i + 1]) - 1 for i in sample_pos]
        for i, _, count in prompt_lp:
            first = int(step.qsl[i])
            logits_idx.extend(range(first, first + count))
        if all_logits is not None and len(logits_idx) == all_logits.shape[0]:
            logits = all_logits  # decode-only graph step where every row samples: (B, V)
        elif all_logits is not None:  # decode-only graph step: one row per sequence
            logits = all_logits.index_select(0, self._h2d(logits_idx))  # (S + P, V)
        else:
            logits = self.model.compute_logits(hidden.index_select(0, self._h2d(logits_idx)))
        sampled_reqs = [batch[i] for i in sample_pos]
        samples = [False] * len(batch)
        for i in sample_pos:
            samples[order[i]] = True
        host: dict[str, torch.Tensor] = {}
        sampled_dev = None
        if sampled_reqs:
            # The index of the token being sampled: with async scheduling the host's token lists
            # lag by the in-flight step, so it comes from the chunk's end, not len(output).
            steps = [int(starts[i] + q_lens[i]) - batch[i].num_prompt_tokens for i in sample_pos]
            meta = build_sampling_metadata(sampled_reqs, self.vocab_size, self.device, steps=steps)
            so = self.sampler(logits[: len(sampled_reqs)], meta)
            sampled_dev = so.sampled_token_ids
            host["sampled"] = self._to_host(sampled_dev)
            if so.logprobs is not None:
                host["lp_ids"] = self._to_host(so.logprob_token_ids)
                host["lp_vals"] = self._to_host(so.logprobs)
                host["lp_ranks"] = self._to_host(so.ranks)
        if prompt_lp:
            targets: list[int] = []
            for i, first, count in prompt_lp:
                targets.extend(batch[i].prompt_token_ids[first + 1:first + 1 + count])
            k = max(batch[i].sampling_params.prompt_logprobs for i, _, _ in prompt_lp)
            tgt = self._h2d(targets)
            lp = compute_token_logprobs(logits[len(sampled_reqs):], tgt, k)
            host["plp_ids"] = self._to_host(lp.token_ids)
            host["plp_vals"] = self._to_host(lp.logprobs)
            host["plp_ranks"] = self._to_host(lp.ranks)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._prev_sampled = sampled_dev
        self._prev_rows = {r.request_id: j for j, r in enumerate(sampled_reqs)}
        return StepHandle(out, sampled_reqs,
                          [(batch[i], first, count) for i, first, count in prompt_lp],
                          samples, host, event)

    def _h2d(self, values: list[int]) -> torch.Tensor:
        """An int64 device tensor from a Python list, without waiting for the in-flight step.

        A copy from pageable memory would first wait for everything queued on the stream, so the
        list goes through pinned memory (the caching host allocator keeps it until the copy ran).
        """
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=torch.long)
        host = torch.tensor(values, dtype=torch.long).pin_memory()
        return host.to(self.device, non_blocking=True)

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return x
        dst = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        return dst.copy_(x, non_blocking=True)

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a launched step and turn its device results into Python lists."""
        t0 = time.perf_counter()
        if handle.event is not None:
            handle.event.synchronize()  # the step's one device->host sync
        self.timing["wait"] += time.perf_counter() - t0
        out = handle.sched
        if not out.scheduled_requests:
            return ModelRunnerOutput([], {}, {})
        host = handle.host
        by_req: dict[str, list[int]] = {}
        if "sampled" in host:
            for r, tok in zip(handle.sampled_reqs, host["sampled"].tolist()):
                by_req[r.request_id] = [tok]
        logprobs: dict[str, TokenLogprobs] = {}
        if "lp_ids" in host:
            ids, lps, ranks = host["lp_ids"].tolist(), host["lp_vals"].tolist(), host["lp_ranks"].tolist()
            for j, r in enumerate(handle.sampled_reqs):
                k = r.sampling_params.logprobs
                if k is not None:
                    logprobs[r.request_id] = TokenLogprobs([ids[j][:k + 1]], [lps[j][:k + 1]], [ranks[j]])
        prompt_logprobs: dict[str, TokenLogprobs] = {}
        if handle.prompt_lp:
            ids, lps = host["plp_ids"].tolist(), host["plp_vals"].tolist()
            ranks = host["plp_ranks"].tolist()
            off = 0
            for r, _, count in handle.prompt_lp:
                kk = r.sampling_params.prompt_logprobs + 1
                prompt_logprobs[r.request_id] = TokenLogprobs(
                    [x[:kk] for x in ids[off:off + count]], [x[:kk] for x in lps[off:off + count]],
                    ranks[off:off + count])
                off += count
        sampled = [by_req.get(r.request_id, []) for r in out.scheduled_requests]
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)


@dataclass
class StepHandle:
    """A launched step: what it scheduled and where its results will land."""

    sched: SchedulerOutput
    sampled_reqs: list[Request]  # requests that sample, in sampler row order
    prompt_lp: list[tuple[Request, int, int]]  # (request, first prompt position, count)
    samples: list[bool]  # per scheduled request (scheduler order): samples a token this step
    host: dict[str, torch.Tensor]  # device->host copies in flight (pinned on CUDA)
    event: torch.cuda.Event | None  # recorded after the copies


@dataclass
class _Step:
    num_tokens: int
    num_seqs: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    width: int  # block-table columns in use
    qsl: np.ndarray  # (B + 1,) query start offsets
    pending_dst: list[int]  # decode rows whose input token is still on the device
    pending_src: list[int]  # their rows in the previous step's sampled tokens


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
