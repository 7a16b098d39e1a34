"""ModelRunner: turns a SchedulerOutput into one flat forward pass, samples, and returns token ids.

The runner keeps every request it was sent in a persistent InputBatch and appends the tokens it
samples itself. With async scheduling a step may be launched before the previous one is collected:
a decode whose input token that step is still sampling reads it from the step's device tensor.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from peregrine.config import EngineConfig
from peregrine.messages import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from peregrine.models.protocol import PipelineStage
from peregrine.sample.logprobs import compute_token_logprobs
from peregrine.sample.sampler import Sampler
from peregrine.spec_decode.proposer import ProposeInput, Proposer
from peregrine.spec_decode.verify import accepted_counts
from peregrine.transfer import download, side_stream, to_device
from peregrine.worker.cuda_graphs import CudaGraphRunner, KVCaches, PiecewiseGraphs
from peregrine.worker.input_batch import InputBatch
from peregrine.worker.step_buffers import StageBuffers, StepBuffers
from peregrine.worker.stage_io import StageIO
from peregrine.worker.step_plan import StepPlan, plan_step
from peregrine.worker.swap import KVSwapSpace
from peregrine.worker.verify_graphs import VerifyGraphs


def _is_run(idx: np.ndarray) -> bool:
    """Whether idx (N >= 1,) is consecutive integers (a slice)."""
    return int(idx[-1]) - int(idx[0]) == idx.size - 1 and bool((np.diff(idx) == 1).all())


@dataclass
class StepHandle:
    """A launched step: what it scheduled and where its results will land."""

    step_id: int
    req_ids: list[str]  # the scheduler's order
    sample_order: list[int]  # scheduler index of each sampled row, in sampler row order
    sample_req_ids: list[str]  # the sampled rows' requests
    sample_generations: np.ndarray  # (S,) their batch generations at launch
    sample_positions: np.ndarray  # (S,) where their tokens go
    num_logprobs: list[int]  # per sampled row: its `logprobs` (-1: none)
    prompt_lp: list[tuple[str, int, int]]  # (request id, positions, top-k) per prompt-logprobs chunk
    host: dict[str, torch.Tensor]  # device->host copies in flight (pinned on CUDA)
    event: torch.cuda.Event | None  # recorded after the copies
    # Speculative decoding: logits rows per sampled row (None: one each), and whether to propose
    # drafts once the step's tokens are known.
    sample_counts: np.ndarray | None = None
    propose: bool = False
    no_propose: list[str] | None = None
    stage_timer: tuple | None = None  # pipeline stages: (start, end) of the step's work here
    draft_tokens: np.ndarray | None = None  # a verify step's (S',) drafts, -1 at each row's end


class ModelRunner:
    """Owns prepare -> forward -> sample on one device: the input batch, step buffers, sampler."""

    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device,
                 stage: PipelineStage | None = None) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.stage = stage if stage is not None else PipelineStage()
        # Pipeline parallelism: hidden states to and from the neighbouring stages, stage timers.
        self.stage_io = (StageIO(self.stage, config.model.hidden_size, config.model.dtype, device)
                         if config.pipeline_parallel_size > 1 else None)
        sc = config.scheduler
        self.block_size = config.cache.block_size
        self.vocab_size = config.model.vocab_size
        self.max_num_tokens = sc.max_num_batched_tokens
        self.max_num_reqs = sc.max_num_seqs
        self.max_blocks_per_req = -(-sc.max_model_len // self.block_size)
        self.batch = InputBatch(self.max_num_reqs, sc.max_model_len, self.max_blocks_per_req,
                                self.vocab_size, device)
        self.buffers = StepBuffers(self.max_num_tokens, self.max_num_reqs, self.max_blocks_per_req,
                                   device)
        self.sampler = Sampler()
        self.kv_caches: KVCaches = []
        self.swap_space: KVSwapSpace | None = None
        self.graphs: CudaGraphRunner | None = None
        self.prefill_graphs: PiecewiseGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        # pipeline stages under CUDA graphs: the graphs' fixed input / output buffers
        self.stage_buffers: StageBuffers | None = None
        # NOTE: a step's results go to the host on a stream of their own: the next step's first
        # kernel, queued behind this step's sampling, does not wait for that copy.
        self._download_stream = side_stream(device)
        self._num_launched = 0
        self._in_flight: dict[int, torch.Tensor] = {}  # uncollected step id -> sampled (S,) tokens
        self.proposer: Proposer | None = None  # speculative decoding (set by the worker)
        # A verify step's tokens reach the batch only when it is collected; a worker that
        # launches the next step first (tensor-parallel ranks > 0) gets it collected here.
        self._uncollected_verify: StepHandle | None = None
        self._collected_early: dict[int, ModelRunnerOutput] = {}
        self.timing: dict[str, float] = defaultdict(float)

    def initialize_kv_cache(self, kv_caches: KVCaches) -> None:
        """Use these per-layer (k_cache, v_cache) pools from now on (and a CPU swap space of
        config.cache.num_cpu_blocks blocks for them)."""
        self.kv_caches = kv_caches
        num_cpu = self.config.cache.num_cpu_blocks
        self.swap_space = KVSwapSpace(kv_caches, num_cpu, self.device) if num_cpu else None

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> StepHandle:
        """Queue one step's forward pass and sampling on the device; return without waiting."""
        t0 = time.perf_counter()
        if self._uncollected_verify is not None:
            early = self._uncollected_verify
            self._collected_early[early.step_id] = self.collect(early)
        if sched.blocks_to_swap_out or sched.blocks_to_swap_in:
            self._swap(sched)
        self._update_states(sched)
        if not sched.num_scheduled_tokens:
            return StepHandle(-1, [], [], [], np.zeros(0, np.int64), np.zeros(0, np.int64), [], [],
                              {}, None)
        if not self.kv_caches:
            raise RuntimeError("the KV cache is not allocated: call initialize_kv_cache first")
        plan = plan_step(self.batch, sched, self.buffers, self.block_size)
        t1 = time.perf_counter()
        hidden, all_logits = self._forward(plan)
        t2 = time.perf_counter()
        if self.stage_io is not None and not self.stage.is_last:
            self.stage_io.send(hidden)  # the last stage samples
            return self._stage_handle(self.stage_io.end_step())
        handle = self._launch_sampling(plan, hidden, all_logits, sched)
        if self.stage_io is not None:
            handle.stage_timer = self.stage_io.end_step()
        if handle.sample_counts is not None:
            self._uncollected_verify = handle
        tm = self.timing
        tm["prepare"] += t1 - t0
        tm["forward_launch"] += t2 - t1
        tm["sample_launch"] += time.perf_counter() - t2
        tm["steps"] += 1
        tm["decode_only_steps"] += plan.num_decodes == plan.num_seqs
        tm["verify_steps"] += plan.draft_tokens is not None
        return handle

    def _stage_handle(self, timer: tuple) -> StepHandle:
        """A pipeline stage before the last: nothing to collect but the step's timer."""
        end = timer[1]
        return StepHandle(-1, [], [], [], np.zeros(0, np.int64), np.zeros(0, np.int64), [], [],
                          {}, None if isinstance(end, float) else end, stage_timer=timer)

    def stage_stats(self, reset: bool = False) -> dict[str, float]:
        """Pipeline parallelism: this stage's steps, busy and idle time (StageIO.stats)."""
        return {} if self.stage_io is None else self.stage_io.stats(reset)

    def _swap(self, sched: SchedulerOutput) -> None:
        """The step's KV block copies, queued before its forward (swap-outs first)."""
        if self.swap_space is None:
            raise RuntimeError("the scheduler sent KV block swaps but this worker has no swap "
                               "space (swap_space is 0)")
        # NOTE: queued behind the step still in flight, whose KV writes they must see (one stream
        # on CUDA; CPU steps run to completion at launch).
        self.swap_space.swap_out(sched.blocks_to_swap_out)
        self.swap_space.swap_in(sched.blocks_to_swap_in)

    def _update_states(self, sched: SchedulerOutput) -> None:
        """Apply the step's request changes to the persistent batch."""
        batch = self.batch
        for rid in sched.finished_req_ids:
            batch.remove_request(rid)
        for rid in sched.preempted_req_ids:
            batch.remove_request(rid)
        if self.proposer is not None and (sched.finished_req_ids or sched.preempted_req_ids):
            self.proposer.remove_requests([*sched.finished_req_ids, *sched.preempted_req_ids])
        for new in sched.scheduled_new_reqs:
            batch.remove_request(new.req_id)  # sent again: its new data replaces what we hold
            batch.add_request(new)
        cached = sched.scheduled_cached_reqs
        try:
            rows = np.fromiter(map(batch.row_of.__getitem__, cached.req_ids), np.int64,
                               cached.num_reqs)  # (C,)
        except KeyError as e:
            raise ValueError(f"cached request {e.args[0]!r} is unknown to the worker") from None
        batch.num_computed_tokens[rows] = cached.num_computed_tokens
        for row, blocks in zip(rows.tolist(), cached.new_block_ids):
            if blocks:
                batch.append_blocks(row, blocks)
        if cached.new_token_ids and not self.stage.is_last:
            # NOTE: the last pipeline stage holds these already: it sampled them.
            for row, tokens in zip(rows.tolist(), cached.new_token_ids):
                if tokens:
                    batch.append_tokens(row, tokens)
        batch.condense()

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(hidden (T, hidden), None) eagerly, or (None, logits) from a CUDA graph: (B, V) for
        a decode graph, (padded T, V) for a verify graph."""
        buf = self.buffers
        t, b = plan.num_tokens, plan.num_seqs
        graph = self.graphs is not None and plan.num_decodes == b and self.graphs.can_run(b)
        pad = self.graphs.padded(b) if graph else None
        vg = self.verify_graphs
        # NOTE: a verify step whose sequences all fit k + 1 query tokens replays a full graph.
        verify = (not graph and vg is not None and plan.draft_tokens is not None
                  and plan.max_query_len <= vg.query_len and vg.can_run(b, t))
        if verify:
            pad = vg.padded(b)
        pieces = (not graph and not verify and self.prefill_graphs is not None
                  and self.prefill_graphs.can_run(t))
        pad_t = (self.prefill_graphs.padded(t) if pieces
                 else vg.num_tokens(pad) if verify else pad)
        # In-flight samples of launched steps become this step's input ids, on the device.
        pending = []
        for step_id in np.unique(plan.pending_step).tolist():
            sampled = self._in_flight.get(step_id)
            if sampled is None:
                raise RuntimeError(f"step {step_id} is collected but its tokens are not on the host")
            sel = plan.pending_step == step_id
            pending.append((sampled, plan.pending_dst[sel], plan.pending_src[sel]))  # (N,), (N,)
        run = None
        if len(pending) == 1 and _is_run(pending[0][1]) and _is_run(pending[0][2]):
            # the usual decode batch: one slice, written with the step's other inputs
            sampled, dst, src = pending.pop()
            run = (sampled.contiguous(), int(dst[0]), int(src[0]), dst.size)
        input_ids, positions, meta = buf.to_device(t, b, plan.width, pad_t=pad_t, pad_b=pad,
                                                   pending=run)
        for sampled, dst, src in pending:
            n = dst.size
            if _is_run(dst) and _is_run(src):
                d0, s0 = int(dst[0]), int(src[0])
                buf.d_input_ids[d0:d0 + n].copy_(sampled[s0:s0 + n])
                continue
            dst, src = to_device(np.stack([dst, src]), self.device)
            buf.d_input_ids.index_copy_(0, dst, sampled.index_select(0, src))
        if graph:
            self._stage_input(pad)
            out = self.graphs.replay(b)  # (B, V); (2, pad, hidden) on a stage before the last
            return (out, None) if self._sends_hidden() else (None, out)
        if verify:
            self.timing["verify_graph_steps"] += 1
            return None, vg.replay(pad)
        meta.num_decodes = plan.num_decodes
        meta.max_query_len = plan.max_query_len
        meta.max_seq_len = plan.max_seq_len
        if pieces:
            self.timing["piecewise_graph_steps"] += 1
            self._stage_input(pad_t)
            return self.prefill_graphs.run(t, meta), None
        if self.stage_io is not None:
            # (2, T, hidden) from the previous stage; None on the first
            intermediate = self.stage_io.begin_step(t)
            if intermediate is not None:
                return self.model(input_ids, positions, self.kv_caches, meta, intermediate), None
        return self.model(input_ids, positions, self.kv_caches, meta), None

    def _stage_input(self, padded: int) -> None:
        """Pipeline stages under CUDA graphs: the previous stage's padded step into the graphs'
        fixed input buffer (the step's work starts here), after the last send from the fixed
        output buffer the graphs are about to rewrite."""
        if self.stage_io is None:
            return
        self.stage_io.wait_sent()
        sb = self.stage_buffers
        self.stage_io.begin_step(padded, None if self.stage.is_first else sb.input(padded),
                                 graph=True)

    def _sends_hidden(self) -> bool:
        return self.stage_io is not None and not self.stage.is_last

    def _logits(self, plan: StepPlan, hidden: torch.Tensor | None,
                all_logits: torch.Tensor | None) -> torch.Tensor:
        """(S + P, V) logits of the sampled rows, then of the prompt-logprobs positions."""
        idx = plan.logits_idx  # (S + P,)
        if all_logits is not None:  # a decode graph's row per sequence, a verify graph's per token
            if idx.size <= all_logits.shape[0] and np.array_equal(idx, np.arange(idx.size)):
                return all_logits[:idx.size]  # (B, V) or the leading rows: a view
            return all_logits.index_select(0, to_device(idx, self.device))
        shared = self.graphs.logits if self.graphs is not None else None
        n = idx.size
        if shared is None or n == 0 or n > shared.shape[0]:  # n == 0: a chunk that samples none
            return self.model.compute_logits(hidden.index_select(0, to_device(idx, self.device)))
        # NOTE: rows padded to a decode graph's batch size (repeating the last row), written into
        # the decode graphs' shared buffer: the LM head then runs only at shapes the graph
        # capture has run (a new GEMM shape's first launch may load its kernel, which waits for
        # the device to go idle), and no logits block is allocated per step.
        pad = self.graphs.padded(n)
        idx = np.concatenate([idx, np.full(pad - n, idx[-1], idx.dtype)]) if pad > n else idx
        rows = hidden.index_select(0, to_device(idx, self.device))  # (pad, hidden)
        return self.model.compute_logits(rows, out=shared[:pad])[:n]  # (S + P, V)

    def _launch_sampling(self, plan: StepPlan, hidden: torch.Tensor | None,
                         all_logits: torch.Tensor | None, sched: SchedulerOutput) -> StepHandle:
        batch = self.batch
        step_id = self._num_launched
        self._num_launched += 1
        logits = self._logits(plan, hidden, all_logits)  # (S' + P, V)
        s = plan.num_sampled_rows
        rows = plan.rows[plan.sample_idx]  # (S,)
        verify = plan.draft_tokens is not None
        host: dict[str, torch.Tensor] = {}
        positions = generations = np.zeros(0, np.int64)
        if s:
            # NOTE: a verify row's positions are sampled as rows of their own, keyed on their
            # token index like plain decodes: accepting while sampled == draft is then exact.
            meta_rows = np.repeat(rows, plan.sample_counts) if verify else rows  # (S',)
            meta = batch.sampling.metadata(meta_rows, plan.flat_steps)
            if sched.structured_req_ids:
                self._add_grammar_masks(meta, plan, sched)
            so = self.sampler(logits[:s], meta)
            # NOTE: penalties count this step's tokens on the device: exact with a step in flight.
            batch.sampling.record_sampled(meta, so.sampled_token_ids)
            # NOTE: a verify step's accepted draft counts come from these tokens on the host.
            host["sampled"] = so.sampled_token_ids  # (S',)
            if so.logprobs is not None:
                host["lp_ids"] = so.logprob_token_ids
                host["lp_vals"] = so.logprobs
                host["lp_ranks"] = so.ranks
            generations = batch.generation[rows].copy()
            positions = batch.append_placeholders(rows, step_id)
            if not verify:  # NOTE: speculation runs synchronously: no later step reads these
                self._in_flight[step_id] = so.sampled_token_ids
        prompt_lp: list[tuple[str, int, int]] = []
        if plan.prompt_idx.size:
            ks = batch.prompt_logprobs[plan.rows[plan.prompt_idx]]  # (P rows,)
            targets = to_device(plan.prompt_targets, self.device)  # (sum counts,)
            lp = compute_token_logprobs(logits[s:], targets, int(ks.max()))
            host["plp_ids"] = lp.token_ids
            host["plp_vals"] = lp.logprobs
            host["plp_ranks"] = lp.ranks
            prompt_lp = [(plan.req_ids[i], c, k) for i, c, k in zip(
                plan.order[plan.prompt_idx].tolist(), plan.prompt_counts.tolist(), ks.tolist())]
        # NOTE: the event follows the copies, which follow all of the step's device work.
        host, event = download(host, self.device, self._download_stream)
        order = plan.order[plan.sample_idx].tolist()
        return StepHandle(step_id, plan.req_ids, order, [plan.req_ids[i] for i in order],
                          generations, positions, batch.sampling.num_logprobs[rows].tolist(),
                          prompt_lp, host, event, plan.sample_counts if verify else None,
                          sched.propose_drafts and self.proposer is not None,
                          sched.no_propose_req_ids,
                          draft_tokens=plan.draft_tokens if verify else None)

    def _add_grammar_masks(self, meta, plan: StepPlan, sched: SchedulerOutput) -> None:
        """Point the step's grammar bitmask rows at the sampler rows of their requests."""
        # NOTE: constrained requests never verify drafts: each has one logits row, after the
        # rows of the sampled rows before it (k + 1 for a verify row).
        first = np.cumsum(plan.sample_counts) - plan.sample_counts  # (S,)
        sample_row = {plan.req_ids[i]: int(f) for i, f in zip(
            plan.order[plan.sample_idx].tolist(), first.tolist())}
        ids = sched.structured_req_ids
        missing = [r for r in ids if r not in sample_row]
        if missing:
            raise ValueError(f"the grammar bitmask names requests that sample nothing this step: "
                             f"{missing}")
        rows = np.fromiter((sample_row[r] for r in ids), np.int64, len(ids))  # (G,)
        self.batch.sampling.add_grammar_masks(meta, rows, sched.grammar_bitmask)

    # ---- results --------------------------------------------------------------------------
    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a launched step and turn its device results into Python lists."""
        early = self._collected_early.pop(handle.step_id, None)
        if early is not None:
            return early
        if self._uncollected_verify is handle:
            self._uncollected_verify = None
        t0 = time.perf_counter()
        if handle.event is not None:
            handle.event.synchronize()  # the step's one device->host sync
        self.timing["wait"] += time.perf_counter() - t0
        if handle.stage_timer is not None:
            self.stage_io.account(handle.stage_timer)
        if not handle.req_ids:
            return ModelRunnerOutput([], [], {}, {})
        self._in_flight.pop(handle.step_id, None)
        host = handle.host
        sampled: list[list[int]] = [[] for _ in handle.req_ids]
        logprobs: dict[str, TokenLogprobs] = {}
        firsts = num_emitted = None
        if "sampled" in host and handle.sample_counts is not None:
            firsts, num_emitted = self._collect_verified(handle, host["sampled"].numpy(), sampled)
        elif "sampled" in host:
            tokens = host["sampled"].tolist()
            self.batch.fill_sampled(handle.sample_req_ids, handle.sample_generations,
                                    handle.sample_positions, tokens, handle.step_id)
            for i, tok in zip(handle.sample_order, tokens):
                sampled[i] = [tok]
        if "lp_ids" in host:
            ids, lps = host["lp_ids"].tolist(), host["lp_vals"].tolist()
            ranks = host["lp_ranks"].tolist()
            for j, (rid, k) in enumerate(zip(handle.sample_req_ids, handle.num_logprobs)):
                if k < 0:
                    continue
                f, n = (j, 1) if firsts is None else (int(firsts[j]), int(num_emitted[j]))
                logprobs[rid] = TokenLogprobs([x[:k + 1] for x in ids[f:f + n]],
                                              [x[:k + 1] for x in lps[f:f + n]], ranks[f:f + n])
        prompt_logprobs: dict[str, TokenLogprobs] = {}
        if handle.prompt_lp:
            ids, lps = host["plp_ids"].tolist(), host["plp_vals"].tolist()
            ranks = host["plp_ranks"].tolist()
            off = 0
            for rid, count, k in handle.prompt_lp:
                prompt_logprobs[rid] = TokenLogprobs(
                    [x[:k + 1] for x in ids[off:off + count]],
                    [x[:k + 1] for x in lps[off:off + count]], ranks[off:off + count])
                off += count
        drafts = self._propose(handle) if handle.propose else {}
        return ModelRunnerOutput(handle.req_ids, sampled, logprobs, prompt_logprobs, drafts)

    def _collect_verified(self, handle: StepHandle, flat: np.ndarray, sampled: list[list[int]]
                          ) -> tuple[np.ndarray, np.ndarray]:
        """A verify step's results: each sampled row emits its accepted drafts plus the next
        sampled token; returns each row's first logits row and emitted count."""
        counts = handle.sample_counts  # (S,)
        tokens = flat  # (S',)
        accepted = accepted_counts(tokens, handle.draft_tokens, counts)  # (S,)
        firsts = np.zeros(counts.size, np.int64)  # (S,)
        np.cumsum(counts[:-1], out=firsts[1:])
        self.batch.fill_sampled(handle.sample_req_ids, handle.sample_generations,
                                handle.sample_positions, tokens[firsts].tolist(), handle.step_id)
        more = np.flatnonzero(accepted > 0)
        if more.size:
            batch = self.batch
            rows = np.fromiter((batch.row_of[handle.sample_req_ids[j]] for j in more.tolist()),
                               np.int64, more.size)
            n = accepted[more]
            offsets = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            batch.append_accepted(rows, handle.sample_positions[more], n,
                                  tokens[np.repeat(firsts[more] + 1, n) + offsets])
        num_emitted = accepted + 1  # (S,)
        ends = (firsts + num_emitted).tolist()
        toks = tokens.tolist()
        for i, f, e in zip(handle.sample_order, firsts.tolist(), ends):
            sampled[i] = toks[f:e]
        return firsts, num_emitted

    def _propose(self, handle: StepHandle) -> dict[str, list[int]]:
        """Drafts for the requests that sampled this step and may speculate."""
        t0 = time.perf_counter()
        batch, k = self.batch, self.config.speculative.num_speculative_tokens
        rows = np.fromiter((batch.row_of.get(r, -1) for r in handle.sample_req_ids), np.int64,
                           len(handle.sample_req_ids))  # (S,)
        if handle.no_propose:
            skip = set(handle.no_propose)
            rows[[i for i, r in enumerate(handle.sample_req_ids) if r in skip]] = -1
        rows = rows[rows >= 0]
        rows = rows[batch.can_speculate[rows]]
        lens = batch.num_tokens[rows]  # (R,)
        # NOTE: the next step emits up to num_draft + 1 tokens within max_model_len and
        # max_tokens, and needs a slot for each draft.
        num_draft = np.minimum.reduce([
            np.full(rows.size, k, np.int64), batch.max_model_len - lens - 1,
            batch.max_tokens[rows] - (lens - batch.num_prompt_tokens[rows]) - 1,
            batch.num_blocks[rows] * self.block_size - lens])  # (R,)
        keep = num_draft > 0
        rows, lens, num_draft = rows[keep], lens[keep], num_draft[keep]
        if not rows.size:
            return {}
        tokens = [batch.token_ids[r, :n] for r, n in zip(rows.tolist(), lens.tolist())]
        blocks = [batch.block_table[r, :n] for r, n in zip(rows.tolist(),
                                                            batch.num_blocks[rows].tolist())]
        for a in (*tokens, *blocks):
            a.flags.writeable = False
        req_ids = [batch.states[r].req_id for r in rows.tolist()]
        proposals = self.proposer.propose(ProposeInput(req_ids, tokens, blocks, num_draft))
        if len(proposals) != len(req_ids):
            raise RuntimeError(f"the proposer returned {len(proposals)} draft lists for "
                               f"{len(req_ids)} requests")
        out = {rid: list(p[:n]) for rid, p, n in zip(req_ids, proposals, num_draft.tolist()) if p}
        self.timing["propose"] += time.perf_counter() - t0
        return out
