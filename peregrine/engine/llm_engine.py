"""LLMEngine: add_request / step / abort over the scheduler and the model runner."""
from __future__ import annotations

import logging
import random
from collections import defaultdict
import time
from collections.abc import Iterable

import numpy as np

from peregrine.config import EngineArgs, EngineConfig
from peregrine.engine.detokenizer import IncrementalDetokenizer
from peregrine.engine.output_processor import RequestGroup, SequenceState, to_position_logprobs
from peregrine.engine.request import Request, RequestStatus
from peregrine.engine.scheduler import Scheduler, SchedulerOutput
from peregrine.engine.stats import EngineStats
from peregrine.outputs import RequestOutput
from peregrine.sampling_params import SamplingParams
from peregrine.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger("peregrine")


def load_tokenizer(path: str):
    """A local Hugging Face fast tokenizer (no remote code, no hub)."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {path!r} ({e}); pass "
                         "skip_tokenizer_init=True to use token ids only") from e


def _needs_exact_host_state(params: SamplingParams) -> bool:
    """Penalties and min_tokens are built from the host's token lists, which lag in async mode."""
    return bool(params.presence_penalty or params.frequency_penalty or
                params.repetition_penalty != 1.0 or params.min_tokens)


class LLMEngine:
    """The synchronous engine core. One thread at a time may call it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.tokenizer = None if mc.skip_tokenizer_init else load_tokenizer(mc.tokenizer)
        self.runner = ModelRunner(config)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.runner.num_blocks)
        self._groups: dict[str, RequestGroup] = {}
        self._seq_group: dict[str, RequestGroup] = {}  # sequence id -> its group
        self._rng = random.Random(mc.seed)
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._last_step_time = 0.0
        self.timing: dict[str, float] = defaultdict(float)  # cumulative host seconds per phase
        async_default = config.device.startswith("cuda")
        self.async_scheduling = (async_default if config.async_scheduling is None
                                 else config.async_scheduling)
        self._inflight: tuple[SchedulerOutput, object] | None = None
        self._num_sync_requests = 0  # live requests whose sampling needs exact host state

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    # ---- requests -------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults applied."""
        return SamplingParams().with_generation_defaults(self.config.model.generation_config, set())

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer (the engine runs with "
                             "skip_tokenizer_init=True): pass token ids instead")
        return self.tokenizer.encode(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request; bad input raises ValueError and leaves the engine unchanged."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise ValueError("priority is only accepted with scheduling_policy='priority'")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = self._validate_prompt(ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = RequestGroup(request_id, text, ids, params, arrival)
        mc = self.config.model
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        source: Request | None = None
        for i, sid in enumerate(seq_ids):
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(62)
            req = Request(sid, ids, params, arrival_time=arrival, priority=priority,
                          eos_token_ids=mc.eos_token_ids, max_tokens=max_tokens, seed=seed,
                          fork_source=source)
            source = source or req
            detok = (IncrementalDetokenizer(self.tokenizer, ids, params)
                     if self.tokenizer is not None else None)
            group.seqs.append(SequenceState(req, detok))
        # NOTE: add to the scheduler first: a full queue raises before any state is kept.
        added: list[str] = []
        try:
            for s in group.seqs:
                self.scheduler.add_request(s.req)
                added.append(s.req.request_id)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self._groups[request_id] = group
        for s in group.seqs:
            self._seq_group[s.req.request_id] = group
        group.needs_sync = _needs_exact_host_state(params)
        self._num_sync_requests += group.needs_sync

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> int:
        limit = self.config.model.max_model_len
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.config.model.vocab_size
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError("a token-id prompt must be a flat list of integers")
        if int(arr.min()) < 0 or int(arr.max()) >= vocab:
            bad = int(arr[(arr < 0) | (arr >= vocab)][0])
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        out_of_vocab = [t for t in (params.logit_bias or {}) if t >= vocab]
        if out_of_vocab:
            raise ValueError(f"logit_bias token id {out_of_vocab[0]} is outside the vocabulary "
                             f"[0, {vocab})")
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens, which leaves no room to generate "
                             f"within max_model_len={limit}")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise ValueError(f"the prompt has {len(ids)} tokens and max_tokens={max_tokens}: together "
                             f"{len(ids) + max_tokens} exceed max_model_len={limit}")
        return max_tokens

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their KV blocks; unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            self._num_sync_requests -= group.needs_sync
            seq_ids = [s.req.request_id for s in group.seqs]
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
            for sid in seq_ids:
                self._seq_group.pop(sid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or self._inflight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and report every request that progressed or finished.

        With async scheduling the step launched here is collected by the next call, so the host
        work of one step overlaps the device work of the previous one.
        """
        t0 = time.perf_counter()
        touched: dict[str, RequestGroup] = {}
        if self._inflight is not None and self._num_sync_requests:
            # NOTE: penalties and min_tokens read exact host token state: no step may be in flight.
            self._complete(*self._inflight, touched)
            self._inflight = None
        sched = self.scheduler.schedule()
        self.timing["schedule"] += time.perf_counter() - t0
        for rid in sched.finished_request_ids:  # e.g. requests that can never fit
            group = self._seq_group.get(rid)
            if group is not None:
                touched[group.request_id] = group
        handle = None
        if sched.total_num_scheduled_tokens:
            now = time.monotonic()
            for req in sched.scheduled_requests:
                self._seq_group[req.request_id].note_scheduled(now)
            t_launch = time.perf_counter()
            handle = self._guard(sched, touched, self.runner.launch, sched)
            self.timing["launch"] += time.perf_counter() - t_launch
            if handle is not None and self.async_scheduling:
                self.scheduler.mark_in_flight(sched, handle.samples)
        if self._inflight is not None:
            self._complete(*self._inflight, touched)
            self._inflight = None
        if handle is not None:
            if self.async_scheduling:
                self._inflight = (sched, handle)
            else:
                self._complete(sched, handle, touched)
        outputs: list[RequestOutput] = []
        for group in touched.values():
            out = group.make_output()
            if out is not None:
                outputs.append(out)
            if group.finished:
                self._retire(group)
        self._last_step_time = time.perf_counter() - t0
        self.timing["step_total"] += self._last_step_time
        return outputs

    def _complete(self, sched: SchedulerOutput, handle, touched: dict[str, RequestGroup]) -> None:
        """Wait for a launched step, apply its tokens to the scheduler and to the outputs."""
        t0 = time.perf_counter()
        result = self._guard(sched, touched, self.runner.collect, handle)
        t1 = time.perf_counter()
        self.timing["collect"] += t1 - t0
        if result is None:
            return
        updated = self.scheduler.update_from_output(sched, result.sampled_token_ids,
                                                    in_flight=self.async_scheduling)
        t2 = time.perf_counter()
        self.timing["update"] += t2 - t1
        self._process(sched, result, updated, touched)
        self.timing["process"] += time.perf_counter() - t2

    def _guard(self, sched: SchedulerOutput, touched: dict[str, RequestGroup], fn, arg):
        """Run a runner call; if it raises, fail that step's requests and keep the engine alive."""
        try:
            return fn(arg)
        except Exception as e:  # noqa: BLE001 - one bad batch must not kill the engine
            logger.exception("model execution failed; failing the %d requests of this step",
                             len(sched.scheduled_requests))
            for req in sched.scheduled_requests:
                req.error = f"model execution failed: {type(e).__name__}: {e}"
                group = self._seq_group.get(req.request_id)
                if group is not None:
                    touched[group.request_id] = group
            self.scheduler.finish_requests([r.request_id for r in sched.scheduled_requests],
                                           RequestStatus.FINISHED_ERROR)
            return None

    def _process(self, sched: SchedulerOutput, result: ModelRunnerOutput, updated: list[Request],
                 touched: dict[str, RequestGroup]) -> None:
        now = time.monotonic()
        for req, n, start in zip(sched.scheduled_requests, sched.num_scheduled_tokens,
                                 sched.num_computed_tokens):
            self._prompt_tokens_total += max(0, min(req.num_prompt_tokens, start + n) - start)
            plp = result.prompt_logprobs.get(req.request_id)
            group = self._seq_group.get(req.request_id)
            if plp is not None and group is not None and group.seqs[0].req is req:
                for ids, lps, rank in zip(plp.token_ids, plp.logprobs, plp.ranks):
                    group.prompt_logprobs.append(to_position_logprobs(ids, lps, rank, self.tokenizer))
                touched[group.request_id] = group
        # NOTE: only tokens the scheduler kept count: a request preempted or aborted while its step
        # was in flight drops that step's token (a recompute samples it again).
        accepted = {id(r) for r in updated}
        for req, new in zip(sched.scheduled_requests, result.sampled_token_ids):
            group = self._seq_group.get(req.request_id)
            if group is None or not new or id(req) not in accepted:
                continue
            try:
                self._on_new_tokens(group, req, new, result)
            except Exception as e:  # noqa: BLE001 - fail only this request
                logger.exception("output processing failed for %s", req.request_id)
                req.error = f"output processing failed: {type(e).__name__}: {e}"
                self.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ERROR)
            group.note_tokens(now, len(new))
            touched[group.request_id] = group
        for req in updated:
            group = self._seq_group.get(req.request_id)
            if group is not None:
                touched[group.request_id] = group

    def _on_new_tokens(self, group: RequestGroup, req: Request, new: list[int],
                       result: ModelRunnerOutput) -> None:
        self._generation_tokens_total += len(new)
        seq = next(s for s in group.seqs if s.req is req)
        lp = result.logprobs.get(req.request_id)
        if lp is not None and seq.logprobs is not None:
            for ids, lps, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
                seq.logprobs.append(to_position_logprobs(ids, lps, rank, self.tokenizer))
                seq.cumulative_logprob += lps[0]
        if seq.detok is None:
            return
        # NOTE: a token that ended the request (eos, stop id) is not rendered as text.
        visible = new
        if req.is_finished and req.status == RequestStatus.FINISHED_STOPPED:
            visible = new[:-1]
        stop = seq.detok.update(visible) if visible else None
        if stop is not None and not req.is_finished:
            req.stop_reason = stop
            self.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_STOPPED)

    def _retire(self, group: RequestGroup) -> None:
        if self._groups.pop(group.request_id, None) is not None:
            self._num_sync_requests -= group.needs_sync
        for s in group.seqs:
            self._seq_group.pop(s.req.request_id, None)

    # ---- introspection --------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        s = self.scheduler.make_stats()
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total, step_time=self._last_step_time)

    def check_health(self) -> None:
        """Raises if the engine cannot serve (kept cheap: called by /health)."""
        if self.runner is None:
            raise RuntimeError("the model runner is gone")
