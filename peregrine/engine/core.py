"""EngineCore: the scheduler and the executor, stepping; what goes in and out of it is plain data.

The core knows token ids only. Tokenizing, detokenizing, stop strings and user-facing outputs live
in the front end (LLMEngine), which talks to the core directly or through a socket to another
process (core_client.py).
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from peregrine.config import EngineConfig
from peregrine.engine.request import Request, RequestStatus
from peregrine.engine.scheduler import Scheduler, SchedulerStats
from peregrine.messages import EMPTY_RUNNER_OUTPUT, SchedulerOutput, TokenLogprobs
from peregrine.sampling_params import SamplingParams
from peregrine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("peregrine")


@dataclass
class EngineCoreRequest:
    """One sequence to generate (a request with n > 1 sends n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    max_tokens: int
    seed: int
    eos_token_ids: tuple[int, ...]
    priority: int = 0
    fork_of: str | None = None  # a sibling whose full prompt blocks it shares
    # The compiled grammar of sampling_params.structured_outputs (structured_output/compiler.py).
    structure: Any = None


@dataclass
class FinishedInfo:
    status: RequestStatus
    stop_reason: int | str | None
    error: str | None


@dataclass
class EngineCoreOutputs:
    """Everything one core step produced, batched: one message per step, not per request."""

    req_ids: list[str] = field(default_factory=list)  # requests that got tokens
    new_token_ids: list[list[int]] = field(default_factory=list)  # parallel to req_ids
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    finished: dict[str, FinishedInfo] = field(default_factory=dict)
    # Requests scheduled for the first time: id -> (time, prefix-cache hit tokens).
    first_scheduled: dict[str, tuple[float, int]] = field(default_factory=dict)
    num_prompt_tokens: int = 0  # prompt tokens computed by the steps reported here
    stats: SchedulerStats | None = None
    step_time: float = 0.0  # host seconds of the core's step

    def __bool__(self) -> bool:
        return bool(self.req_ids or self.finished or self.first_scheduled or self.prompt_logprobs)


class EngineCore:
    """Owns the scheduler and the executor; one thread at a time may call it."""

    def __init__(self, config: EngineConfig, executor_class: type | None = None) -> None:
        from peregrine.executor import executor_class_for
        self.config = config
        self.executor = (executor_class or executor_class_for(config))(config)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.executor.num_blocks,
                                   config.speculative)
        self.pipeline = StepPipeline(config)
        self.structured = StructuredOutputManager(config.model.vocab_size)
        self.timing: dict[str, float] = defaultdict(float)  # cumulative host seconds per phase
        # Seconds the last step() waited for the device to finish the step launched before it
        # (None when it collected no such step).
        self.last_device_wait: float | None = None

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, r: EngineCoreRequest) -> None:
        """Queue a sequence; a ValueError (e.g. an id in use) leaves the core unchanged."""
        source = self.scheduler.get_request(r.fork_of) if r.fork_of is not None else None
        req = Request(r.request_id, r.prompt_token_ids, r.sampling_params,
                      arrival_time=r.arrival_time, priority=r.priority,
                      eos_token_ids=r.eos_token_ids, max_tokens=r.max_tokens, seed=r.seed,
                      fork_source=source)
        if r.sampling_params.structured_outputs is not None and r.structure is None:
            raise ValueError("structured_outputs reached the engine core without its compiled "
                             "grammar (LLMEngine.add_request compiles it)")
        self.scheduler.add_request(req)
        if r.structure is not None:
            self.structured.add(r.request_id, r.structure)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish these sequences now and free their KV blocks; unknown ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.scheduler.take_finished()  # the front end already knows: nothing to report
        self.structured.remove(request_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.pipeline.busy

    def reset_prefix_cache(self) -> int:
        return self.scheduler.reset_prefix_cache()

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Schedule and launch one step; report what finished on the device since the last call."""
        t0 = time.perf_counter()
        self.last_device_wait = None
        out = EngineCoreOutputs()
        sched = self.scheduler.schedule()
        self.timing["schedule"] += time.perf_counter() - t0
        now = time.monotonic()
        reqs = self.scheduler.requests_of(sched)
        for req in reqs:
            if req.scheduled_time is None:
                req.scheduled_time = now
                out.first_scheduled[req.request_id] = (now, max(req.num_cached_tokens, 0))
        out.num_prompt_tokens = _prompt_tokens(sched, reqs)
        if self.structured:
            t1 = time.perf_counter()
            masks = self.structured.bitmask(self.scheduler.requests, sched.num_scheduled_tokens)
            if masks is not None:
                sched.structured_req_ids, sched.grammar_bitmask = masks
            self.timing["structured"] += time.perf_counter() - t1
        self.pipeline.run(self, sched, out)
        for req in self.scheduler.take_finished():
            out.finished[req.request_id] = FinishedInfo(req.status, req.stop_reason, req.error)
            if self.structured:
                self.structured.remove((req.request_id,))
        out.stats = self.scheduler.make_stats()
        out.step_time = time.perf_counter() - t0
        self.timing["step_total"] += out.step_time
        return out

    def launch(self, sched: SchedulerOutput):
        """Queue the step on the workers; on failure its requests finish with the error."""
        t0 = time.perf_counter()
        try:
            return self.executor.execute_model(sched)
        except Exception as e:  # noqa: BLE001 - one bad batch must not kill the engine
            self._fail(sched, e)
            return None
        finally:
            self.timing["launch"] += time.perf_counter() - t0

    def complete(self, sched: SchedulerOutput, future, out: EngineCoreOutputs,
                 in_flight: bool) -> None:
        """Wait for a launched step and apply its tokens."""
        t0 = time.perf_counter()
        try:
            result = future.result() if future is not None else EMPTY_RUNNER_OUTPUT
        except Exception as e:  # noqa: BLE001
            self._fail(sched, e)
            return
        t1 = time.perf_counter()
        self.timing["collect"] += t1 - t0
        if in_flight:
            self.last_device_wait = t1 - t0
        reqs = self.scheduler.requests_of(sched)
        kept = {id(r) for r in self.scheduler.update_from_output(sched, result, in_flight)}
        if self.structured:
            t2 = time.perf_counter()
            self._advance_grammars()
            self.timing["structured"] += time.perf_counter() - t2
        if result.prompt_logprobs:  # NOTE: rare; most steps skip this loop over the batch
            for req in reqs:
                rid = req.request_id
                if rid in result.prompt_logprobs and req.status != RequestStatus.FINISHED_ABORTED:
                    out.prompt_logprobs[rid] = result.prompt_logprobs[rid]
        # NOTE: only tokens the scheduler kept count: a request preempted or aborted while its
        # step was in flight drops that step's token (a recompute samples it again).
        req_ids, new_token_ids, logprobs = out.req_ids, out.new_token_ids, result.logprobs
        for req in reqs:
            if id(req) not in kept:
                continue
            rid = req.request_id
            output_ids = req.output_token_ids
            req_ids.append(rid)
            new_token_ids.append(output_ids[req.num_reported_tokens:])
            req.num_reported_tokens = len(output_ids)
            if rid in logprobs:
                lp = logprobs[rid]
                num_new = len(new_token_ids[-1])
                if len(lp.token_ids) > num_new:
                    # NOTE: a stop inside a verify step's accepted tokens cut the rest.
                    lp = TokenLogprobs(lp.token_ids[:num_new], lp.logprobs[:num_new],
                                       lp.ranks[:num_new])
                out.logprobs[rid] = lp
        self.timing["update"] += time.perf_counter() - t1

    def _advance_grammars(self) -> None:
        """Feed the kept tokens to the matchers; a terminated grammar stops its request (also with
        ignore_eos), a rejected token fails it."""
        live = self.scheduler.requests
        terminated, rejected = self.structured.accept(live)
        for rid in terminated:
            live[rid].stop_reason = None
        if terminated:
            self.scheduler.finish_requests(terminated, RequestStatus.FINISHED_STOPPED)
        for rid, error in rejected:
            live[rid].error = error
            self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ERROR)

    def _fail(self, sched: SchedulerOutput, e: Exception) -> None:
        logger.exception("model execution failed; failing the %d requests of this step",
                         len(sched.num_scheduled_tokens))
        self.scheduler.fail_step(sched, f"model execution failed: {type(e).__name__}: {e}")


class StepPipeline:
    """Where a launched step waits for its results: at once (sync), one step later (async), or,
    with pipeline parallelism, up to pipeline_parallel_size steps later (a batch queue).

    With async scheduling, step N+1 is scheduled and launched before step N is collected, so the
    host's scheduling and output work overlaps the device's work on step N. With P pipeline
    stages, up to P steps are in flight, each with requests the others do not have (the
    scheduler skips requests in flight), so while stage 2 runs step N, stage 1 runs step N+1.
    """

    def __init__(self, config: EngineConfig) -> None:
        default = config.device.startswith("cuda")
        self.async_scheduling = default if config.async_scheduling is None else config.async_scheduling
        self._inflight: tuple[SchedulerOutput, object] | None = None
        self.depth = config.scheduler.max_concurrent_batches
        self._queue: deque[tuple[SchedulerOutput, object]] = deque()  # oldest first
        self.max_in_flight = 0  # the most steps the batch queue has held at once

    @property
    def busy(self) -> bool:
        return self._inflight is not None or bool(self._queue)

    def run(self, core: EngineCore, sched: SchedulerOutput, out: EngineCoreOutputs) -> None:
        if self.depth > 1:
            self._run_batch_queue(core, sched, out)
            return
        has_tokens = sched.total_num_scheduled_tokens > 0
        # NOTE: a step with no tokens still goes to the workers when it tells them to forget
        # finished or preempted requests; otherwise their rows would stay taken.
        future = None
        if has_tokens or sched.finished_req_ids or sched.preempted_req_ids:
            future = core.launch(sched)
        # NOTE: a step that samples a constrained row completes at once: the next step's bitmask
        # needs its token (structured_output/manager.py). So does a step after which drafts are
        # proposed (the proposer reads its tokens) or that verifies drafts (the accepted count
        # decides the next step's inputs).
        pipelined = (future is not None and has_tokens and self.async_scheduling
                     and not sched.structured_req_ids and not sched.propose_drafts
                     and not sched.scheduled_spec_decode_tokens)
        if pipelined:
            core.scheduler.mark_in_flight(sched)
        if self._inflight is not None:
            core.complete(*self._inflight, out, in_flight=True)
            self._inflight = None
        if pipelined:
            self._inflight = (sched, future)
        elif future is not None or not has_tokens:
            core.complete(sched, future, out, in_flight=False)

    def _run_batch_queue(self, core: EngineCore, sched: SchedulerOutput,
                         out: EngineCoreOutputs) -> None:
        """Queue the step; collect the oldest once `depth` steps are in flight, or when this step
        launched nothing (every runnable request waits on a step in flight)."""
        has_tokens = sched.total_num_scheduled_tokens > 0
        future = None
        if has_tokens or sched.finished_req_ids or sched.preempted_req_ids:
            future = core.launch(sched)
        # NOTE: a constrained row's next bitmask needs its token: that step completes at once.
        queued = future is not None and has_tokens and not sched.structured_req_ids
        queue = self._queue
        if queued:
            core.scheduler.mark_in_flight(sched)
            queue.append((sched, future))
            self.max_in_flight = max(self.max_in_flight, len(queue))
            if len(queue) >= self.depth:
                core.complete(*queue.popleft(), out, in_flight=True)
            return
        if has_tokens and future is not None:  # a constrained step: what came before, then it
            while queue:
                core.complete(*queue.popleft(), out, in_flight=True)
        elif queue:
            core.complete(*queue.popleft(), out, in_flight=True)
        if future is not None or not has_tokens:
            core.complete(sched, future, out, in_flight=False)


def _prompt_tokens(sched: SchedulerOutput, reqs: list[Request]) -> int:
    counts = sched.num_scheduled_tokens
    total = 0
    for req in reqs:
        start = req.num_computed_tokens
        num_prompt = len(req.prompt_token_ids)
        if start < num_prompt:  # NOTE: decodes (past the prompt) add nothing: skip the lookup
            total += min(num_prompt, start + counts[req.request_id]) - start
    return total
