"""A request's state as the scheduler and the model runner see it: integers and lists only."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from peregrine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from peregrine.kv_cache.hashing import BlockHash


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # its KV was dropped: recomputed when it resumes
    SWAPPED = 3  # its KV blocks wait in the CPU swap space: copied back when it resumes
    # Everything from here on is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
_FIRST_FINISHED = int(RequestStatus.FINISHED_STOPPED)


class Request:
    """One sequence being generated. `n > 1` requests are split into several of these."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 *, arrival_time: float, priority: int = 0, eos_token_ids: tuple[int, ...] = (),
                 max_tokens: int, seed: int = 0, fork_source: Request | None = None,
                 cache_salt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.priority = priority
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens  # resolved: never None
        self.seed = seed  # always set: the sampler's random stream is keyed on it
        # NOTE: a sibling of an n>1 request shares the prompt blocks its fork_source computed.
        self.fork_source = fork_source
        # Extra key for prefix hashes (tenants, later adapters): SamplingParams.cache_salt unless
        # given here.
        self.cache_salt = cache_salt if cache_salt is not None else sampling_params.cache_salt

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Tokens sampled by steps still running on the GPU (async scheduling): their ids are unknown
        # on the host yet, but the scheduler already counts them as computed-to-be.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit tokens at first scheduling (-1: not yet)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.block_ids: list[int] = []  # owned by the KV cache manager
        self.block_hashes: list[BlockHash] = []  # hashes of the full blocks of all_token_ids
        self.num_preemptions = 0
        self.scheduled_time: float | None = None
        self.num_reported_tokens = 0  # output tokens the core has reported to the front end
        # Speculative decoding: drafts proposed after the last step, verified by the next one.
        self.spec_token_ids: list[int] = []
        self.spec_misses = 0  # verify steps in a row that accepted no draft
        self.spec_empty = 0  # proposals in a row that found no draft
        self.spec_skip = 0  # steps to decode plainly before verifying drafts again

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        # NOTE: compares plain ints: this runs for every request on every step.
        return self.status >= _FIRST_FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_output_tokens(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
