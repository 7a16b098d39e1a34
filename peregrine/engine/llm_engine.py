"""LLMEngine: the front end over an engine core (tokenize, validate, detokenize, stop strings)."""
from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from peregrine.config import EngineArgs, EngineConfig
from peregrine.engine.core import EngineCoreOutputs, EngineCoreRequest
from peregrine.engine.core_client import CoreClient, ProcessCoreClient, make_core_client
from peregrine.engine.detokenizer import IncrementalDetokenizer
from peregrine.engine.output_processor import RequestGroup, SequenceState, to_position_logprobs
from peregrine.engine.request import Request, RequestStatus
from peregrine.engine.stats import EngineStats
from peregrine.outputs import RequestOutput
from peregrine.sampling_params import SamplingParams
from peregrine.startup_timing import STARTUP
from peregrine.structured_output import StructuredOutputsParams

logger = logging.getLogger("peregrine")


def load_tokenizer(path: str):
    """A local Hugging Face tokenizer (no remote code, no hub): peregrine.tokenizer's choice."""
    from peregrine.tokenizer import load_tokenizer as load
    return load(path)


class _TokenizerLoad:
    """load_tokenizer(path) in a thread of its own; result() returns it (or raises its error) and
    records its time as an overlapped start-up phase."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._value = self._error = None
        self._seconds = 0.0
        self._thread = threading.Thread(target=self._load, name="tokenizer-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            self._value = load_tokenizer(self._path)
        except BaseException as e:  # handed to the caller by result()
            self._error = e
        self._seconds = time.perf_counter() - t0

    def wait(self) -> None:
        """Wait for the load; raise its error, if any."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    def result(self):
        self.wait()
        STARTUP.overlapped("tokenizer", self._seconds)
        return self._value


class QueueFullError(ValueError):
    """Raised by add_request when max_queue_len requests are already waiting to start."""


class LLMEngine:
    """Requests in, RequestOutputs out; the scheduler and the model run in the engine core.

    The core runs in this process or in its own (`engine_core_process`); either way one thread
    at a time may call the engine.
    """

    def __init__(self, config: EngineConfig, core_client: CoreClient | None = None) -> None:
        self.config = config
        mc = config.model
        STARTUP.begin(join=True)  # from_engine_args began it, before the config
        # NOTE: the tokenizer loads in a thread while the engine core starts (a core process is
        # spawned first; an in-process core loads the model here meanwhile).
        spawned = built = None
        if core_client is None and config.engine_core_process:
            with STARTUP.phase("engine_core_spawn"):
                spawned = core_client = ProcessCoreClient(config, wait=False)
        tokenizer = None if mc.skip_tokenizer_init else _TokenizerLoad(mc.tokenizer)
        try:
            if spawned is not None and tokenizer is not None:
                tokenizer.wait()  # NOTE: a broken tokenizer fails before the core is waited for
            # NOTE: in this process the workers' phases nest under engine_core; a core process
            # logs its own line.
            with STARTUP.phase("engine_core"):
                if spawned is not None:
                    spawned.wait_ready()
                if core_client is None:
                    built = core_client = make_core_client(config)
            self.tokenizer = tokenizer.result() if tokenizer is not None else None
            self.core_client = core_client
        except BaseException:
            for started in (spawned, built):
                if started is not None:
                    started.shutdown()
            raise
        self._groups: dict[str, RequestGroup] = {}
        self._seqs: dict[str, tuple[RequestGroup, SequenceState]] = {}  # sequence id -> state
        self._unscheduled: set[str] = set()  # sequences not yet scheduled: the waiting queue
        self._rng = random.Random(mc.seed)
        self._stats = EngineStats()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._structure_compiler = None  # built on the first structured_outputs request
        self._structure_lock = threading.Lock()
        self.timing: dict[str, float] = defaultdict(float)  # cumulative host seconds per phase
        self.startup_seconds = STARTUP.finish()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        STARTUP.begin()
        with STARTUP.phase("import_torch"):
            import torch  # noqa: F401  (the config's first torch use would import it)
        with STARTUP.phase("config"):
            config = args.create_engine_config()
        return cls(config)

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
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (the engine runs with "
                             "skip_tokenizer_init=True): use stop_token_ids")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer (the engine runs with "
                                 "skip_tokenizer_init=True)")
            params = params.with_bad_word_tokens(
                lambda w: self.tokenizer.encode(w, add_special_tokens=False))
        structure = (self.compile_structure(params.structured_outputs)
                     if params.structured_outputs is not None else None)
        limit = self.config.scheduler.max_queue_len
        if limit is not None and params.n > limit:
            raise ValueError(f"n={params.n} sequences can never wait in a queue of "
                             f"max_queue_len={limit}")
        if limit is not None and len(self._unscheduled) + params.n > limit:
            raise QueueFullError(f"{len(self._unscheduled)} sequences are already waiting to "
                                 f"start (max_queue_len={limit})")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = RequestGroup(request_id, text, ids, params, arrival)
        mc = self.config.model
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        core_reqs: list[EngineCoreRequest] = []
        for i, sid in enumerate(seq_ids):
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(62)
            core_reqs.append(EngineCoreRequest(sid, ids, params, arrival, max_tokens, seed,
                                               mc.eos_token_ids, priority,
                                               fork_of=seq_ids[0] if i else None,
                                               structure=structure))
            # NOTE: the front end mirrors each sequence's tokens and status for its outputs.
            req = Request(sid, ids, params, arrival_time=arrival, eos_token_ids=mc.eos_token_ids,
                          max_tokens=max_tokens, seed=seed)
            detok = (IncrementalDetokenizer(self.tokenizer, ids, params)
                     if self.tokenizer is not None and params.detokenize else None)
            group.seqs.append(SequenceState(req, detok))
        self.core_client.add_requests(core_reqs)
        self._groups[request_id] = group
        for s in group.seqs:
            self._seqs[s.req.request_id] = (group, s)
        self._unscheduled.update(seq_ids)

    def compile_structure(self, so: StructuredOutputsParams):
        """The grammar of `so`, compiled in the front end and cached by canonical text; a
        ValueError naming the field when it does not compile. Thread-safe: a server compiles off
        the engine thread first, so that add_request finds it in the cache."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer (the engine runs with "
                             "skip_tokenizer_init=True)")
        with self._structure_lock:
            if self._structure_compiler is None:
                import copy

                from peregrine.structured_output.compiler import StructureCompiler
                mc = self.config.model
                # NOTE: a copy: HF fast tokenizers must not be used from two threads at once, and
                # the engine thread detokenizes with self.tokenizer.
                self._structure_compiler = StructureCompiler(
                    copy.deepcopy(self.tokenizer), mc.tokenizer, mc.vocab_size, mc.eos_token_ids)
            compiler = self._structure_compiler
        return compiler.compile(so)

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> int:
        """The prompt's one check (the core trusts it); returns the resolved max_tokens."""
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
        out_of_vocab = [t for t in (params.allowed_token_ids or ()) if t >= vocab]
        if out_of_vocab:
            raise ValueError(f"allowed_token_ids token id {out_of_vocab[0]} is outside the "
                             f"vocabulary [0, {vocab})")
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens, which leaves no room to generate "
                             f"within max_model_len={limit}")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise ValueError(f"the prompt has {len(ids)} tokens and max_tokens={max_tokens}: together "
                             f"{len(ids) + max_tokens} exceed max_model_len={limit}")
        return max_tokens

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Stop requests now and free their KV blocks; returns their final outputs
        (finish_reason "abort"); unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        seq_ids: list[str] = []
        finals: list[RequestOutput] = []
        for rid in ids:
            group = self._groups.get(rid)
            if group is None:
                continue
            for s in group.seqs:
                if not s.req.is_finished:
                    s.req.status = RequestStatus.FINISHED_ABORTED
                    seq_ids.append(s.req.request_id)
            finals.append(group.make_output(force=True))
            self._retire(group)
        if seq_ids:
            self.core_client.abort_requests(seq_ids)
        return finals

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run the core one step (or take what its process produced) and report progress."""
        t0 = time.perf_counter()
        batches = self.core_client.get_outputs()
        t1 = time.perf_counter()
        self.timing["core"] += t1 - t0
        touched: dict[str, RequestGroup] = {}
        stop_ids: list[str] = []
        for out in batches:
            self._apply(out, touched, stop_ids)
        if stop_ids:
            self.core_client.abort_requests(stop_ids)
        outputs: list[RequestOutput] = []
        for group in touched.values():
            out = group.make_output()
            # NOTE: no output means a FINAL_ONLY group that has not finished.
            if out is not None:
                outputs.append(out)
                if out.finished:
                    self._retire(group)
        self.timing["process"] += time.perf_counter() - t1
        self.timing["step_total"] += time.perf_counter() - t0
        return outputs

    def _apply(self, out: EngineCoreOutputs, touched: dict[str, RequestGroup],
               stop_ids: list[str]) -> None:
        """Fold one core step's results into the sequences' mirrors (tokens, text, status)."""
        now = time.monotonic()
        for sid, (when, cached) in out.first_scheduled.items():
            entry = self._seqs.get(sid)
            self._unscheduled.discard(sid)
            if entry is not None:
                entry[1].req.num_cached_tokens = cached
                entry[0].note_scheduled(when)
        for sid, plp in out.prompt_logprobs.items():
            entry = self._seqs.get(sid)
            if entry is not None and entry[0].seqs[0] is entry[1]:
                group = entry[0]
                tokenizer = self.tokenizer if group.params.detokenize else None
                for ids, lps, rank in zip(plp.token_ids, plp.logprobs, plp.ranks):
                    group.prompt_logprobs.append(to_position_logprobs(ids, lps, rank, tokenizer))
                touched[group.request_id] = group
        seqs, finished = self._seqs, out.finished
        for sid, new in zip(out.req_ids, out.new_token_ids):
            entry = seqs.get(sid)
            if entry is None or entry[1].req.is_finished:
                continue  # aborted, or stopped by a stop string while this step ran
            group, seq = entry
            try:
                if self._on_new_tokens(seq, new, out, finished.get(sid)):
                    stop_ids.append(sid)
            except Exception as e:  # noqa: BLE001 - fail only this request
                logger.exception("output processing failed for %s", sid)
                seq.req.error = f"output processing failed: {type(e).__name__}: {e}"
                seq.req.status = RequestStatus.FINISHED_ERROR
                stop_ids.append(sid)
            group.note_tokens(now, len(new))
            touched[group.request_id] = group
        for sid, info in out.finished.items():
            entry = self._seqs.get(sid)
            if entry is None:
                continue
            req = entry[1].req
            if not req.is_finished:
                req.status, req.stop_reason, req.error = info.status, info.stop_reason, info.error
            self._unscheduled.discard(sid)
            touched[entry[0].request_id] = entry[0]
        self._prompt_tokens_total += out.num_prompt_tokens
        if out.stats is not None:
            st = out.stats
            self._stats = EngineStats(
                num_running=st.num_running, num_waiting=st.num_waiting,
                kv_cache_usage=st.kv_cache_usage, prefix_cache_queries=st.prefix_cache_queries,
                prefix_cache_hits=st.prefix_cache_hits, num_preemptions=st.num_preemptions,
                num_swapped_out=st.num_swapped_out, num_swapped_in=st.num_swapped_in,
                num_swapped=st.num_swapped, cpu_cache_usage=st.cpu_cache_usage,
                prompt_tokens_total=self._prompt_tokens_total,
                generation_tokens_total=self._generation_tokens_total, step_time=out.step_time,
                spec_num_drafts=st.spec_num_drafts, spec_num_draft_tokens=st.spec_num_draft_tokens,
                spec_num_accepted_tokens=st.spec_num_accepted_tokens)

    def _on_new_tokens(self, seq: SequenceState, new: list[int], out: EngineCoreOutputs,
                       finished) -> bool:
        """Append tokens, logprobs and text; True when a stop string ended the sequence."""
        req = seq.req
        self._generation_tokens_total += len(new)
        req.append_output_tokens(new)
        lp = out.logprobs.get(req.request_id)
        if lp is not None and seq.logprobs is not None:
            tokenizer = self.tokenizer if req.sampling_params.detokenize else None
            for ids, lps, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
                seq.logprobs.append(to_position_logprobs(ids, lps, rank, tokenizer))
                seq.cumulative_logprob += lps[0]
        if seq.detok is None:
            return False
        # NOTE: a token that ended the request (eos, stop id) is not rendered as text.
        visible = new
        if finished is not None and finished.status == RequestStatus.FINISHED_STOPPED:
            visible = new[:-1]
        stop = seq.detok.update(visible) if visible else None
        if stop is None:
            return False
        req.status = RequestStatus.FINISHED_STOPPED
        req.stop_reason = stop
        return finished is None  # still running in the core: abort it there

    def _retire(self, group: RequestGroup) -> None:
        if self._groups.pop(group.request_id, None) is None:
            return
        for s in group.seqs:
            self._seqs.pop(s.req.request_id, None)
            self._unscheduled.discard(s.req.request_id)

    def wake(self) -> None:
        """Cut short a step() that is waiting for the core (thread-safe; new work arrived)."""
        self.core_client.wake()

    # ---- introspection --------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        """The last step's snapshot; with no request left (the last ones aborted between steps,
        so no step came after), no request is running, waiting or swapped either."""
        if not self._groups and (self._stats.num_running or self._stats.num_waiting
                                 or self._stats.num_swapped):
            self._stats = dataclasses.replace(self._stats, num_running=0, num_waiting=0,
                                              num_swapped=0)
        return self._stats

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (after the requests in flight)."""
        self.core_client.reset_prefix_cache()

    def check_health(self) -> None:
        """Raises if the engine cannot serve (kept cheap: called by /health)."""
        self.core_client.check_health()

    def shutdown(self) -> None:
        """Stop the engine core (its process, if it has one) and release the device."""
        self.core_client.shutdown()
