"""What crosses the scheduler -> executor -> worker boundary: plain, picklable data, no live objects.

A request's full data travels once (`NewRequestData`); after that each step carries only deltas
(`CachedRequestData`). A worker keeps its own copy of every request's state and appends the tokens it
samples itself, so nothing per token flows back into it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from peregrine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen (or forgot after it was preempted)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # keys the sampler's random stream
    eos_token_ids: tuple[int, ...]  # banned until min_tokens (unless ignore_eos)
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit (or shared fork prefix) already in the KV cache
    # Tokens generated before a preemption; the recompute feeds them as input again.
    output_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = None  # resolved output limit (caps speculative drafts); None: none


@dataclass
class CachedRequestData:
    """Per-step deltas of requests the workers already hold, one entry per column."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # blocks appended since last step
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step's tokens
    # Pipeline parallelism only (else empty): per request, the output tokens sampled since it was
    # last sent; the stages before the last sample nothing, so they learn the tokens here.
    new_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step: who runs, how many tokens each, what to forget."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # Request id -> tokens to compute this step, in batch order (new requests after cached ones).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: list[str]  # their KV blocks are gone: workers drop them until resumed
    finished_req_ids: list[str]  # finished since the last step: workers free their state
    # KV block copies the workers make before this step's forward, as (src, dst) block ids:
    # device -> CPU swap space for requests swapped out now, CPU -> device for those resumed now.
    # NOTE: a step never has both (nothing is admitted in a step that preempts), and swap-outs
    # are applied first anyway, so a device block freed by one is read before it is rewritten.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Structured outputs: the constrained requests that sample this step and, row for row, their
    # allowed next tokens as a (G, ceil(V / 32)) int32 bitmask (bit t of a row allows token t).
    structured_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding: request id -> the draft tokens scheduled after its last token (its
    # num_scheduled_tokens counts them); the step verifies them (spec_decode/verify.py).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Whether the workers propose drafts for their requests after this step, and requests that
    # want none (backing off after rejected drafts).
    propose_drafts: bool = False
    no_propose_req_ids: list[str] = field(default_factory=list)


@dataclass
class TokenLogprobs:
    """Top-N logprobs of consecutive positions: ids[i][0] is the chosen token, ids[i][1:] the top-N."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """A step's results; a request may get several tokens in one step (speculative decoding)."""

    req_ids: list[str]  # the step's scheduled requests, in SchedulerOutput.num_scheduled_tokens order
    sampled_token_ids: list[list[int]]  # parallel to req_ids; [] for a chunk that samples nothing
    logprobs: dict[str, TokenLogprobs]  # request id -> logprobs of this step's sampled tokens
    prompt_logprobs: dict[str, TokenLogprobs]  # request id -> logprobs of this chunk's prompt tokens
    # Speculative decoding: request id -> drafts proposed after this step, for the next one.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


EMPTY_RUNNER_OUTPUT = ModelRunnerOutput([], [], {}, {})
