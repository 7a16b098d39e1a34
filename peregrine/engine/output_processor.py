"""Turns per-sequence progress into user-facing RequestOutputs (detokenize, stop strings, logprobs, n>1)."""
from __future__ import annotations

import time

from peregrine.engine.detokenizer import decode_logprob_tokens
from peregrine.engine.request import Request, RequestStatus
from peregrine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from peregrine.sampling_params import RequestOutputKind, SamplingParams


def to_position_logprobs(ids: list[int], lps: list[float], rank: int, tokenizer) -> PositionLogprobs:
    """{token: Logprob}: the chosen token with its rank, then the top-N with ranks 1..N."""
    decoded = decode_logprob_tokens(tokenizer, ids) if tokenizer is not None else [None] * len(ids)
    entry: PositionLogprobs = {ids[0]: Logprob(lps[0], rank, decoded[0])}
    for j in range(1, len(ids)):
        if ids[j] not in entry:
            entry[ids[j]] = Logprob(lps[j], j, decoded[j])
    return entry


# NOTE: module names for the enum members read on every output (an Enum class lookup is slow).
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY
_DELTA = RequestOutputKind.DELTA
_ERROR = RequestStatus.FINISHED_ERROR


class SequenceState:
    """Text, logprobs and what was already reported for one of a group's n sequences."""

    def __init__(self, req: Request, detok) -> None:
        self.req = req
        self.detok = detok
        self.logprobs: list[PositionLogprobs] | None = [] if req.sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if self.logprobs is not None else None
        self.sent_tokens = 0
        self.sent_logprobs = 0

    @property
    def text(self) -> str:
        return self.detok.output_text if self.detok is not None else ""


class RequestGroup:
    """One user request: n sequences sharing a prompt, reported together."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs: list[SequenceState] = []
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.sent_prompt_logprobs = 0
        self.needs_sync = False  # set by the engine: sampling reads exact host token state
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # NOTE: a plain loop: this runs for every touched group every step
            if not s.req.is_finished:
                return False
        return True

    def note_scheduled(self, now: float) -> None:
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now

    def note_tokens(self, now: float, count: int) -> None:
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        self.metrics.num_generation_tokens += count

    def make_output(self, force: bool = False) -> RequestOutput | None:
        """The output to report now, per the output kind (None: nothing to report yet)."""
        kind = self.params.output_kind
        finished = self.finished
        if kind is _FINAL_ONLY and not finished and not force:
            return None
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.monotonic()
        delta = kind is _DELTA
        outputs = [self._completion(i, s, delta) for i, s in enumerate(self.seqs)]
        plp = self.prompt_logprobs
        if plp is not None and delta:
            plp, self.sent_prompt_logprobs = plp[self.sent_prompt_logprobs:], len(plp)
        error = None
        for s in self.seqs:
            if s.req.status is _ERROR:
                error = s.req.error
                break
        first = self.seqs[0].req
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=outputs, finished=finished, prompt_logprobs=plp,
            num_cached_tokens=max(first.num_cached_tokens, 0), metrics=self.metrics, error=error)

    @staticmethod
    def _completion(index: int, s: SequenceState, delta: bool) -> CompletionOutput:
        req = s.req
        lps = s.logprobs
        if delta:
            tokens = req.output_token_ids[s.sent_tokens:]
            # NOTE: the detokenizer holds back a possible stop-string prefix until it is resolved.
            text = s.detok.get_delta_text(final=req.is_finished) if s.detok is not None else ""
            s.sent_tokens = len(req.output_token_ids)
            if lps is not None:
                lps, s.sent_logprobs = lps[s.sent_logprobs:], len(lps)
        else:
            tokens, text = list(req.output_token_ids), s.text
        return CompletionOutput(index=index, text=text, token_ids=tokens,
                                cumulative_logprob=s.cumulative_logprob, logprobs=lps,
                                finish_reason=req.status.finish_reason, stop_reason=req.stop_reason)
