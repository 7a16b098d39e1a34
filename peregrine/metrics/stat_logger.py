"""A periodic one-line summary of the engine: token throughput, queue sizes, KV and prefix cache."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from peregrine.engine.stats import EngineStats

logger = logging.getLogger("peregrine.metrics")


def format_stats_line(prev: EngineStats, cur: EngineStats, dt: float) -> str:
    """One log line for the interval between two snapshots `dt` seconds apart."""
    dt = max(dt, 1e-9)
    prompt_tps = (cur.prompt_tokens_total - prev.prompt_tokens_total) / dt
    gen_tps = (cur.generation_tokens_total - prev.generation_tokens_total) / dt
    queries = cur.prefix_cache_queries - prev.prefix_cache_queries
    hits = cur.prefix_cache_hits - prev.prefix_cache_hits
    # NOTE: hit rate over this interval; with no lookups in it, fall back to the lifetime rate.
    hit_rate = hits / queries if queries > 0 else cur.prefix_cache_hit_rate
    return (f"prompt throughput: {prompt_tps:.1f} tokens/s, generation throughput: "
            f"{gen_tps:.1f} tokens/s, running: {cur.num_running} reqs, waiting: "
            f"{cur.num_waiting} reqs, KV cache usage: {cur.kv_cache_usage * 100:.1f}%, "
            f"prefix cache hit rate: {hit_rate * 100:.1f}%{_spec_part(prev, cur)}")


def _spec_part(prev: EngineStats, cur: EngineStats) -> str:
    """Speculative decoding over the interval: draft acceptance rate and mean acceptance length."""
    drafts = cur.spec_num_drafts - prev.spec_num_drafts
    if drafts <= 0:
        return ""
    proposed = cur.spec_num_draft_tokens - prev.spec_num_draft_tokens
    accepted = cur.spec_num_accepted_tokens - prev.spec_num_accepted_tokens
    return (f", draft acceptance rate: {accepted / max(proposed, 1) * 100:.1f}%, mean acceptance "
            f"length: {1 + accepted / drafts:.2f}")


def _is_idle(prev: EngineStats, cur: EngineStats) -> bool:
    return (cur.num_running == 0 and cur.num_waiting == 0
            and cur.prompt_tokens_total == prev.prompt_tokens_total
            and cur.generation_tokens_total == prev.generation_tokens_total)


class StatLogger:
    """Logs `format_stats_line` every `interval` seconds; an idle engine is logged once."""

    def __init__(self, stats_fn: Callable[[], EngineStats], interval: float = 5.0,
                 log: logging.Logger | None = None) -> None:
        if interval <= 0:
            raise ValueError(f"log interval must be > 0 seconds, got {interval}")
        self.stats_fn = stats_fn
        self.interval = interval
        self.log = log or logger
        self._prev = stats_fn()
        self._prev_time = time.monotonic()
        self._logged_idle = True  # nothing to say before the first request

    def log_once(self, now: float | None = None) -> str | None:
        """Log (and return) a line if there was activity since the last call."""
        now = time.monotonic() if now is None else now
        cur = self.stats_fn()
        idle = _is_idle(self._prev, cur)
        line = None
        if not (idle and self._logged_idle):
            line = format_stats_line(self._prev, cur, now - self._prev_time)
            self.log.info("%s", line)
        self._logged_idle = idle
        self._prev, self._prev_time = cur, now
        return line

    async def run(self) -> None:
        """Log forever (cancel the task to stop)."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.log_once()
            except Exception:  # noqa: BLE001 - logging must never take the server down
                self.log.exception("stat logging failed")
