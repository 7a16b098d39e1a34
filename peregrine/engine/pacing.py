"""When the core process schedules its next step: as late as the device allows, listening for
new requests until then.

With async scheduling the core schedules step N+1 as soon as it has collected step N-1, that is
while the device starts step N: a whole step ahead. A request that arrives a moment later misses
step N+1 and starts in step N+2, so at light load it waits one and a half steps on average before
its prefill runs.

The pacer spends part of the host's idle time listening instead of blocking: after a step, the
core waits on its inbox for a budget of seconds, and schedules the next step when a request
arrives or the budget runs out. The device is never left without work: the budget is the host's
idle time per step (time blocked on the device plus time spent listening), the lowest over the
last few steps, less a margin. If the budget ever overshoots, the idle time measured shrinks to
what was slept, and the budget falls by at least the margin each step until it fits again.

Every millisecond of margin is a millisecond in which an arriving request misses the next step,
so the margin is small: 0.4 ms (a tenth of the idle time when that is larger). Served on an H200
at 8 requests/s, the former max(1 ms, 25%) left ~2 ms of every ~4.8 ms decode step deaf, while
with 0.4 ms the device still waited under 0.01 ms per step on average for the host
(benchmarks/pacing_trace.py).
"""
from __future__ import annotations

from collections import deque


class LaunchPacer:
    """Budget for listening between steps; see the module docstring."""

    def __init__(self, window: int = 8, min_margin_s: float = 0.0004,
                 margin_fraction: float = 0.1, min_budget_s: float = 0.0005) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self._idle: deque[float] = deque(maxlen=window)
        self._min_margin_s = min_margin_s
        self._margin_fraction = margin_fraction
        self._min_budget_s = min_budget_s
        self._listened = 0.0  # listened after the last step, before the step now on the device

    def observe(self, device_wait_s: float | None) -> None:
        """Record a step that waited device_wait_s for the step launched before it (None: the
        step collected nothing in flight, so the pipeline restarted and the history is stale)."""
        if device_wait_s is None:
            self._idle.clear()
        else:
            self._idle.append(self._listened + device_wait_s)
        self._listened = 0.0

    def budget(self) -> float:
        """Seconds the core may listen for requests before scheduling the next step (0: none)."""
        if len(self._idle) < self._idle.maxlen:
            return 0.0
        idle = min(self._idle)
        budget = idle - max(self._min_margin_s, self._margin_fraction * idle)
        return budget if budget >= self._min_budget_s else 0.0

    def listened(self, seconds: float) -> None:
        """Record the time actually spent listening (a request may have cut the budget short)."""
        self._listened = seconds
