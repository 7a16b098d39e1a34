"""A snapshot of the engine's counters, taken between steps (read by metrics and /health)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """Gauges are values now; `*_total`, prefix-cache and preemption counts are cumulative."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # cumulative prompt tokens found there
    num_preemptions: int = 0  # cumulative, recompute and swap
    num_swapped_out: int = 0  # cumulative preemptions that copied the request's blocks to the CPU
    num_swapped_in: int = 0  # cumulative swapped requests resumed
    num_swapped: int = 0  # requests whose blocks are in the CPU swap space now
    cpu_cache_usage: float = 0.0  # fraction of CPU swap blocks in use, 0..1
    prompt_tokens_total: int = 0  # cumulative prompt tokens computed (prefill)
    generation_tokens_total: int = 0  # cumulative tokens sampled
    step_time: float = 0.0  # seconds the last step took
    # Speculative decoding, cumulative: verify steps (one per request verified), drafts verified,
    # drafts accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any)."""
        return self.spec_num_accepted_tokens / max(self.spec_num_draft_tokens, 1)

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a verify step emits per request on average: accepted drafts + 1 (0 before any)."""
        if self.spec_num_drafts <= 0:
            return 0.0
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cumulative hit rate in tokens (0 when nothing was queried)."""
        if self.prefix_cache_queries <= 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
