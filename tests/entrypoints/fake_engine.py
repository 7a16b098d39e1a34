"""A deterministic stand-in for LLMEngine (same API), with knobs to inject failures and stalls."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from peregrine.engine.llm_engine import QueueFullError
from peregrine.engine.stats import EngineStats
from peregrine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from peregrine.sampling_params import RequestOutputKind, SamplingParams
from peregrine.testing.tokenizer import build_bpe_tokenizer

EOS_ID = 1
# The fake engine emits these single-byte tokens in a cycle ("Ġ" is byte-level BPE's space).
CYCLE_TOKENS = list("abcdefgh") + ["Ġ"]


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)
    sent: int = 0
    finish_reason: str | None = None


@dataclass
class _Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[_Seq]
    blocks: int = 0


class FakeEngine:
    """One token per running request per step; tokens cycle through `_CYCLE`."""

    def __init__(self, *, max_model_len: int = 128, max_num_seqs: int = 64, num_blocks: int = 1024,
                 block_size: int = 4, max_queue_len: int | None = None,
                 served_model_name: str = "fake-model", step_delay: float = 0.0) -> None:
        self.tokenizer = build_bpe_tokenizer(None)
        self.cycle = self.tokenizer.convert_tokens_to_ids(CYCLE_TOKENS)
        self.config = SimpleNamespace(
            model=SimpleNamespace(served_model_name=served_model_name, max_model_len=max_model_len,
                                  vocab_size=len(self.tokenizer), model="/fake/model",
                                  generation_config={}),
            scheduler=SimpleNamespace(max_queue_len=max_queue_len, max_num_seqs=max_num_seqs))
        self.max_num_seqs = max_num_seqs
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.step_delay = step_delay
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # failure injection
        self.fail_requests_with_prompt: set[int] = set()  # first prompt token id -> request errors
        self.fail_next_steps = 0  # step() raises this many times
        self.stall = threading.Event()  # while set, step() blocks
        self.thread_ids: set[int] = set()  # threads that called into the engine
        self.received: list[SamplingParams] = []  # the params of every request added, in order

    def _touch(self) -> None:
        self.thread_ids.add(threading.get_ident())

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        self._touch()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.config.model.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token id outside the vocabulary [0, {vocab})")
        if any(r.request_id == request_id for r in self.waiting + self.running):
            raise ValueError(f"request id {request_id!r} is already in use")
        limit = self.config.scheduler.max_queue_len
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(f"{len(self.waiting)} requests are already waiting")
        self.received.append(params)
        now = time.monotonic() if arrival_time is None else arrival_time
        self.waiting.append(_Req(request_id, ids, params, RequestMetrics(arrival_time=now),
                                 [_Seq() for _ in range(params.n)]))

    def compile_structure(self, so) -> None:
        """LLMEngine compiles structured_outputs here; the fake samples without constraints."""
        self._touch()

    def abort_request(self, request_ids) -> None:
        self._touch()
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        self.waiting = [r for r in self.waiting if r.request_id not in ids]
        self.running = [r for r in self.running if r.request_id not in ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def get_stats(self) -> EngineStats:
        used = sum(r.blocks for r in self.running)
        return EngineStats(num_running=len(self.running), num_waiting=len(self.waiting),
                           kv_cache_usage=used / self.num_blocks,
                           prompt_tokens_total=self.prompt_tokens_total,
                           generation_tokens_total=self.generation_tokens_total)

    def step(self) -> list[RequestOutput]:
        self._touch()
        while self.stall.is_set():
            time.sleep(0.01)
        if self.fail_next_steps > 0:
            self.fail_next_steps -= 1
            raise RuntimeError("injected step failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        now = time.monotonic()
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.pop(0)
            req.metrics.first_scheduled_time = now
            self.prompt_tokens_total += len(req.prompt_ids)
            self.running.append(req)
        outputs = []
        for req in list(self.running):
            error = None
            if req.prompt_ids[0] in self.fail_requests_with_prompt:
                error = "injected request failure"
            for i, seq in enumerate(req.seqs):
                if seq.finish_reason is not None:
                    continue
                if error is not None:
                    seq.finish_reason = "error"
                    continue
                tok = self.cycle[(len(seq.tokens) + i) % len(self.cycle)]
                seq.tokens.append(tok)
                self.generation_tokens_total += 1
                if tok in req.params.stop_token_ids:
                    seq.finish_reason = "stop"
                elif len(seq.tokens) >= req.params.max_tokens:
                    seq.finish_reason = "length"
            total = len(req.prompt_ids) + max(len(s.tokens) for s in req.seqs)
            req.blocks = -(-total // self.block_size) * len(req.seqs)
            finished = all(s.finish_reason is not None for s in req.seqs)
            outputs.append(self._output(req, finished, error))
            if finished:
                self.running.remove(req)
        return outputs

    def _output(self, req: _Req, finished: bool, error: str | None) -> RequestOutput:
        delta = req.params.output_kind == RequestOutputKind.DELTA
        outs = []
        for i, seq in enumerate(req.seqs):
            toks = seq.tokens[seq.sent:] if delta else list(seq.tokens)
            seq.sent = len(seq.tokens)
            lps = None
            if req.params.logprobs is not None:
                lps = [self._logprobs(t, req.params.logprobs) for t in toks]
            outs.append(CompletionOutput(index=i, text=self.tokenizer.decode(toks), token_ids=toks,
                                         logprobs=lps, finish_reason=seq.finish_reason))
        return RequestOutput(req.request_id, None, req.prompt_ids, outs, finished,
                             metrics=req.metrics, error=error)

    def _logprobs(self, tok: int, num: int) -> dict[int, Logprob]:
        entry = {tok: Logprob(-0.25, 1, self.tokenizer.decode([tok]))}
        for r in range(2, num + 1):
            other = 100 + r
            entry[other] = Logprob(-1.0 * r, r, self.tokenizer.decode([other]))
        return entry
