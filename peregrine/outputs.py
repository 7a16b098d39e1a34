"""What the engine returns for each request (names as in vLLM)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the sampled/actual token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request failed (finish_reason "error")
    extra: dict = field(default_factory=dict)


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One delta output covering two consecutive delta outputs of the same request."""
    outputs = []
    for a, b in zip(first.outputs, then.outputs):
        lps = None if a.logprobs is None and b.logprobs is None else \
            (a.logprobs or []) + (b.logprobs or [])
        outputs.append(CompletionOutput(
            index=b.index, text=a.text + b.text, token_ids=a.token_ids + b.token_ids,
            cumulative_logprob=b.cumulative_logprob, logprobs=lps,
            finish_reason=b.finish_reason, stop_reason=b.stop_reason))
    plp = None if first.prompt_logprobs is None and then.prompt_logprobs is None else \
        (first.prompt_logprobs or []) + (then.prompt_logprobs or [])
    return RequestOutput(
        request_id=then.request_id, prompt=then.prompt, prompt_token_ids=then.prompt_token_ids,
        outputs=outputs, finished=then.finished, prompt_logprobs=plp,
        num_cached_tokens=then.num_cached_tokens, metrics=then.metrics,
        error=then.error, extra={**first.extra, **then.extra})
