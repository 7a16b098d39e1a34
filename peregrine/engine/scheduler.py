"""Iteration-level continuous batching: each step picks which requests run, for how many tokens.

Pure integer bookkeeping: decodes and prefill chunks share one token budget, so chunked prefill
and continuous batching are the same mechanism. Out of KV blocks, the scheduler preempts the last
admitted (or lowest-priority) request, by recompute (its blocks are freed and it re-queues with
num_computed_tokens = 0) or by swap (its blocks are copied to the CPU swap space and back when it
resumes; preemption_mode; swap_preemption.py decides which).
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import TYPE_CHECKING

from peregrine.engine.request import Request, RequestStatus
from peregrine.engine.scheduler_output import SchedulerStats, StepEncoder
from peregrine.engine.spec_scheduling import DraftScheduling
from peregrine.engine.swap_preemption import SwapPreemption
from peregrine.kv_cache.manager import NO_COMPUTED_BLOCKS, KVCacheManager
from peregrine.messages import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from peregrine.config import CacheConfig, SchedulerConfig
    from peregrine.spec_decode.config import SpeculativeConfig

__all__ = ["Scheduler", "SchedulerStats"]


class Scheduler:
    """Owns the waiting queue, the running list and the KV cache manager."""

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 speculative: SpeculativeConfig | None = None) -> None:
        if config.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {config.policy!r} "
                             "(expected fcfs or priority)")
        if config.preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError(f"unknown preemption mode {config.preemption_mode!r} "
                             "(expected auto, recompute or swap)")
        self.config = config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching, cache_config.num_cpu_blocks)
        self.swap = SwapPreemption(config, self.kv)
        # This step's block copies for the workers (see SchedulerOutput).
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: list[Request] = []  # in policy order: the head is admitted first
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self._add_order: dict[str, int] = {}  # last tie-breaker of the priority order
        self._num_added = 0
        self._finished_ids: list[str] = []  # reported by the next schedule()
        self._finished_reqs: list[Request] = []  # reported by take_finished()
        self._errored: list[Request] = []  # finished inside schedule(), returned by update
        # The Request objects of each step not yet updated, keyed by id(SchedulerOutput).
        self._steps: dict[int, list[Request]] = {}
        # Pipeline parallelism (max_concurrent_batches > 1): several steps are in flight, each
        # with requests no other one has; a request in one is not scheduled again until it is
        # updated (its next input token is not known yet), and the workers learn the tokens
        # sampled since a request was last sent (CachedRequestData.new_token_ids).
        self._batch_queue = config.max_concurrent_batches > 1
        self._in_flight_ids: set[str] = set()
        self._encoder = StepEncoder(send_new_tokens=self._batch_queue)
        self.spec = DraftScheduling(speculative, config, self.kv)  # speculative decoding
        # Cumulative: verify steps (one per request verified), drafts verified, drafts accepted.
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0

    # ---- queue management -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, if any."""
        return self.requests.get(request_id)

    def add_request(self, req: Request) -> None:
        """Queue a new request (the front end has validated its prompt and admitted it)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self._add_order[req.request_id] = self._num_added
        self._num_added += 1
        self._enqueue(req, front=False)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests (abort, stop string) in any state, freeing blocks; skips unknown ids."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is not None:
                self._finish(req, status)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many were dropped."""
        return self.kv.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        """A snapshot of queue sizes, cache usage and cumulative counters."""
        kv = self.kv
        num_cpu = kv.cpu_pool.num_blocks
        return SchedulerStats(len(self.running), len(self.waiting), kv.usage,
                              kv.prefix_cache_queries, kv.prefix_cache_hits,
                              self.num_preemptions, self.swap.num_swapped_out,
                              self.swap.num_swapped_in,
                              kv.num_swapped_requests,
                              1.0 - kv.num_free_cpu_blocks / num_cpu if num_cpu else 0.0,
                              self.spec_num_drafts, self.spec_num_draft_tokens,
                              self.spec_num_accepted_tokens)

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch: running requests, then (if none was preempted) waiting ones."""
        budget = self.config.max_num_batched_tokens
        self._errored = []  # only the update right after this schedule() reports them
        scheduled: dict[Request, int] = {}  # insertion-ordered: the batch order
        preempted: list[Request] = []
        cap = self._step_request_cap()
        speculate = self.spec.begin_step(len(self.running))
        drafts: dict[Request, list[int]] = {}
        i = 0
        while i < len(self.running) and budget > 0:
            if cap is not None and len(scheduled) >= cap:
                break
            req = self.running[i]
            if self._in_flight_ids and req.request_id in self._in_flight_ids:
                i += 1
                continue
            num_new = self._num_new_tokens(req)
            num_new = min(num_new, budget)
            if num_new <= 0:
                i += 1
                continue
            if speculate and self.spec.take_drafts(req, num_new, budget, drafts):
                num_new += len(drafts[req])
            while not self.kv.allocate_slots(req, num_new):
                victim = self._select_victim()
                if victim is req and len(self.running) == 1:
                    if self.swap.release_holds(req, self.waiting):
                        continue
                    # Alone and still out of blocks: it can never grow further in this pool.
                    self._finish_error(req, req.num_computed_tokens + num_new)
                    break
                victim_index = self.running.index(victim)
                self._preempt(victim)
                preempted.append(victim)
                budget += scheduled.pop(victim, 0)
                drafts.pop(victim, None)
                if victim is req:
                    break
                if victim_index < i:
                    i -= 1
            else:
                scheduled[req] = num_new
                budget -= num_new
                i += 1
        if not preempted:
            self._admit(scheduled, budget, cap)
        finished_ids, self._finished_ids = self._finished_ids, []
        out = self._encoder.encode(scheduled, [r.request_id for r in preempted], finished_ids)
        self.spec.end_step(out, scheduled, drafts)
        assert not (self._swap_out and self._swap_in), "a step both swaps out and admits"
        out.blocks_to_swap_out, self._swap_out = self._swap_out, []
        out.blocks_to_swap_in, self._swap_in = self._swap_in, []
        self._steps[id(out)] = list(scheduled)
        return out

    def _step_request_cap(self) -> int | None:
        """Pipeline parallelism: the most requests one step takes, so that the requests split
        evenly over the steps in flight (one step taking them all would leave the other stages
        idle); None without a batch queue."""
        if not self._batch_queue:
            return None
        live = min(self.config.max_num_seqs, len(self.running) + len(self.waiting))
        return max(1, -(-live // self.config.max_concurrent_batches))

    def take_finished(self) -> list[Request]:
        """Requests finished (any reason) since the last call."""
        done, self._finished_reqs = self._finished_reqs, []
        return done

    def requests_of(self, out: SchedulerOutput) -> list[Request]:
        """The requests a step scheduled (in num_scheduled_tokens order), until it is updated."""
        return self._steps.get(id(out), [])

    def _num_new_tokens(self, req: Request) -> int:
        """Tokens of a running request still to compute, counting in-flight samples as known."""
        pending = req.num_output_placeholders
        num_tokens = len(req.all_token_ids)
        max_model_len = self.config.max_model_len
        if pending and (len(req.output_token_ids) + pending >= req.max_tokens or
                        num_tokens + pending >= max_model_len):
            return 0  # the in-flight token is its last one: nothing more to schedule
        return min(num_tokens + pending, max_model_len) - req.num_computed_tokens

    def mark_in_flight(self, out: SchedulerOutput) -> None:
        """Async scheduling: count a launched step as computed before its results come back.

        A request whose chunk reaches its last known token samples one; until
        update_from_output(..., in_flight=True) delivers it, that token is a placeholder.
        """
        counts, running = out.num_scheduled_tokens, RequestStatus.RUNNING
        for req in self._steps.get(id(out), ()):
            if req.status != running:
                continue
            if self._batch_queue:
                self._in_flight_ids.add(req.request_id)
            num = counts[req.request_id]
            if req.num_computed_tokens + num >= len(req.all_token_ids) + req.num_output_placeholders:
                req.num_output_placeholders += 1
            req.num_computed_tokens += num

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput,
                           in_flight: bool = False) -> list[Request]:
        """Advance computed tokens, append sampled tokens, run stop checks, free finished requests.

        Returns the requests that got new tokens or finished (including those finished with an
        error inside the preceding schedule(), so call this even for an empty batch).
        """
        reqs = self._steps.pop(id(out), [])
        if self._in_flight_ids:
            self._in_flight_ids.difference_update(out.num_scheduled_tokens)
        spec_tokens = out.scheduled_spec_decode_tokens
        draft_out = result.draft_token_ids
        if spec_tokens and in_flight:
            raise ValueError("speculative steps run without async scheduling")
        if result.req_ids != [r.request_id for r in reqs]:
            raise ValueError(f"the step's output names {len(result.req_ids)} requests, not the "
                             f"{len(reqs)} it scheduled in that order")
        changed, self._errored = self._errored, []
        counts = out.num_scheduled_tokens
        cache_computed_blocks = self.kv.cache_computed_blocks
        running = RequestStatus.RUNNING
        for req, tokens in zip(reqs, result.sampled_token_ids):
            if req.status != running:
                continue  # aborted (or otherwise finished) since schedule(); its blocks are gone
            if in_flight:
                # NOTE: mark_in_flight already advanced num_computed_tokens at launch.
                req.num_output_placeholders -= len(tokens)
            else:
                req.num_computed_tokens += counts[req.request_id]
                if spec_tokens:
                    num_d = len(spec_tokens.get(req.request_id, ()))
                    if num_d:
                        num_accepted = self.spec.verified(req, num_d, len(tokens))
                        self.spec_num_drafts += 1
                        self.spec_num_draft_tokens += num_d
                        self.spec_num_accepted_tokens += num_accepted
                assert req.num_computed_tokens <= req.num_tokens + max(len(tokens) - 1, 0), \
                    f"{req} computed past its tokens"
            if not tokens:
                cache_computed_blocks(req)
                continue  # a prefill chunk that did not reach the end of the known tokens
            assert in_flight or req.num_computed_tokens == req.num_tokens + len(tokens) - 1, \
                f"{req} sampled before its last token"
            status = None
            for token in tokens:
                req.append_output_token(token)
                status = self._check_stop(req, token)
                if status is not None:
                    break
            # NOTE: after the append: a verify step's accepted drafts complete blocks too.
            cache_computed_blocks(req)
            if status is not None:
                self._finish(req, status)
            else:
                self.spec.take_proposal(
                    req, draft_out.get(req.request_id, []) if draft_out else [],
                    out.propose_drafts)
            changed.append(req)
        return changed

    def fail_step(self, out: SchedulerOutput, error: str) -> list[Request]:
        """The workers could not run a step: finish its requests with `error`; returns them."""
        failed = [r for r in self._steps.pop(id(out), []) if not r.is_finished]
        self._in_flight_ids.difference_update(out.num_scheduled_tokens)
        for req in failed:
            req.error = error
            self._finish(req, RequestStatus.FINISHED_ERROR)
        for rid in out.preempted_req_ids:
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.SWAPPED:
                # NOTE: its copy-out may not have run: it recomputes instead.
                self.kv.free(req)
                req.num_computed_tokens = 0
                req.status = RequestStatus.PREEMPTED
        return failed

    # ---- internals ----------------------------------------------------------------------------

    def _admit(self, scheduled: dict[Request, int], budget: int, cap: int | None = None) -> None:
        cfg = self.config
        if budget <= 0 or len(self.running) >= cfg.max_num_seqs or not self.waiting:
            return
        admitted: set[int] = set()
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                break
            if cap is not None and len(scheduled) >= cap:
                break
            if req.status == RequestStatus.SWAPPED:
                num_new = self.swap.swap_in(req, budget, self._swap_in, self.waiting,
                                            bool(self.running))
                if not num_new:
                    break  # out of device blocks (or budget without chunking): later ones wait too
                self.running.append(req)
                admitted.add(id(req))
                scheduled[req] = num_new
                budget -= num_new
                continue
            shared = self._fork_tokens(req)
            if shared is None:
                continue  # its fork source has not computed the shared prompt blocks yet
            need = min(req.num_tokens + 1, cfg.max_model_len)
            if self.kv.num_blocks_for(need) > self.kv.num_blocks:
                self._finish_error(req, need)
                continue
            computed = NO_COMPUTED_BLOCKS if shared else self.kv.get_computed_blocks(req)
            start = shared or computed.num_tokens
            num_new = min(req.num_tokens, cfg.max_model_len) - start
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    break
                num_new = budget
            look = self.spec.admit_lookahead(req, start + num_new)
            if shared:
                assert req.fork_source is not None
                self.kv.fork(req.fork_source, req, shared)
                req.num_computed_tokens = shared
                ok = (look and self.kv.allocate_slots(req, num_new + look)
                      or self.kv.allocate_slots(req, num_new))
                if not ok:
                    self.kv.free(req)
                    req.num_computed_tokens = 0
            else:
                ok = (look and self.kv.allocate_slots(req, num_new + look, computed)
                      or self.kv.allocate_slots(req, num_new, computed))
            if not ok:
                break  # out of blocks: later requests wait too
            req.num_computed_tokens = start
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = start
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.add(id(req))
            scheduled[req] = num_new
            budget -= num_new
        if admitted:
            self.waiting = [r for r in self.waiting if id(r) not in admitted]

    def _fork_tokens(self, req: Request) -> int | None:
        """Tokens req can share with its fork source now (0: go alone), or None to keep waiting."""
        src = req.fork_source
        if src is None or src.is_finished or src.status in (RequestStatus.PREEMPTED,
                                                             RequestStatus.SWAPPED):
            return 0
        if req.sampling_params.prompt_logprobs is not None:
            return 0  # needs the logits of every prompt position, so it computes them itself
        # NOTE: share only full prompt blocks, and keep >= 1 token to compute so logits exist.
        num_blocks = min(req.num_prompt_tokens, req.num_tokens - 1) // self.block_size
        target = num_blocks * self.block_size
        if target == 0:
            return 0
        if src.status == RequestStatus.RUNNING and src.num_computed_tokens >= target:
            return target
        return None

    def _select_victim(self) -> Request:
        # NOTE: a request in an in-flight step is never preempted: it could be admitted again
        # while that step still holds it. The request being scheduled is not in flight.
        running = self.running
        if self._in_flight_ids:
            running = [r for r in running if r.request_id not in self._in_flight_ids]
        if self.config.policy == "fcfs":
            return running[-1]
        # Largest (priority, arrival_time); among equals, the most recently admitted.
        return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._encoder.forget(req.request_id)  # the workers drop it; resumed, it is new
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        if not self.swap.swap_out(req, self._swap_out):
            self.kv.free(req)
            req.num_computed_tokens = 0
            # NOTE: an in-flight sample of a preempted request is dropped; the recompute draws it
            # again (same seed and step, so the same token).
            req.num_output_placeholders = 0
            req.status = RequestStatus.PREEMPTED
        self._enqueue(req, front=True)

    def _enqueue(self, req: Request, front: bool) -> None:
        if self.config.policy == "priority":
            bisect.insort(self.waiting, req, key=self._priority_key)
        elif front:
            self.waiting.insert(0, req)
        else:
            self.waiting.append(req)

    def _priority_key(self, req: Request) -> tuple[int, float, int]:
        return (req.priority, req.arrival_time, self._add_order[req.request_id])

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        num_output = len(req.output_token_ids)
        reached_min = num_output >= sp.min_tokens
        if reached_min and not sp.ignore_eos and token in req.eos_token_ids:
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if reached_min and token in sp.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if num_output >= req.max_tokens or len(req.all_token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        self._encoder.forget(req.request_id)
        del self.requests[req.request_id]
        del self._add_order[req.request_id]
        self._finished_ids.append(req.request_id)
        self._finished_reqs.append(req)

    def _finish_error(self, req: Request, num_tokens: int) -> None:
        need = self.kv.num_blocks_for(num_tokens)
        pool = self.kv.num_blocks
        req.error = (f"request needs {need} KV cache blocks ({num_tokens} tokens) but the whole "
                     f"cache has only {pool} blocks ({pool * self.block_size} tokens of block_size "
                     f"{self.block_size}); raise the KV cache size or shorten the request")
        self._finish(req, RequestStatus.FINISHED_ERROR)
        self._errored.append(req)
