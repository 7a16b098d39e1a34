"""Where a process's start-up time goes: seconds per phase, logged as one line when it is ready.

The engine's front end (`LLMEngine`) and every worker record their phases into the one
`STARTUP` of their process (start-up happens once per process); the line reads

    start-up phases (s): pre_engine=4.51 config=0.02 tokenizer=1.60 engine_core=5.10
    engine_core/device=0.80 engine_core/model=0.40 ... engine_core/other=0.05 other=0.01 total=11.24

A phase opened inside another is named parent/child; `other` is the time no phase covers, so the
phases of each level add up to their parent (and the top level to `total`). A phase that ran in
another thread beside them (`tokenizer_overlapped`: the tokenizer loads while the engine core
starts) ends in OVERLAPPED and is left out of those sums. `pre_engine` is the
time from the process's start to the engine's first phase: interpreter start-up, imports, and
whatever the program did before it built the engine.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger("peregrine")

LINE_PREFIX = "start-up phases (s):"
OVERLAPPED = "_overlapped"  # the name's suffix of a phase that ran beside the others


def process_age() -> float | None:
    """Seconds since this process started (10 ms resolution), or None without Linux's /proc."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        # NOTE: field 22 (starttime, clock ticks since boot) counts after the ")" that closes the
        # command name, which may itself hold spaces.
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME)
                   - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupPhases:
    """Seconds of each start-up phase of this process, in the order the phases began."""

    def __init__(self, clock: Any = time.perf_counter, age: Any = process_age) -> None:
        self._clock = clock
        self._age = age
        self.seconds: dict[str, float] = {}
        self._open: list[str] = []
        self._begun: float | None = None
        self._pre_engine_taken = False
        self._active = False

    @property
    def active(self) -> bool:
        """Whether an engine's start-up is being timed here (begin called, finish not yet)."""
        return self._active

    def begin(self, join: bool = False) -> None:
        """Start timing an engine's start-up afresh (the first time: after pre_engine); with
        join, only when none is being timed already."""
        if join and self._active:
            return
        self.seconds.clear()
        self._open.clear()
        self._begun = self._clock()
        self._active = True
        self.take_pre_engine()

    def take_pre_engine(self) -> None:
        """Record the process's age as `pre_engine`, once per process (later engines have
        none)."""
        if self._pre_engine_taken:
            return
        self._pre_engine_taken = True
        age = self._age()
        if age is not None:
            self.seconds["pre_engine"] = age

    @contextmanager
    def phase(self, name: str, device: Any = None) -> Iterator[None]:
        """Time the block as `name` (inside another phase: parent/name). With a CUDA `device` the
        block's queued GPU work is waited for, so it is counted here and not in the next phase."""
        if "/" in name or "=" in name or " " in name:
            raise ValueError(f"a start-up phase name has no '/', '=' or space: {name!r}")
        if self._begun is None:
            self._begun = self._clock()
        key = "/".join([*self._open, name])
        self.seconds.setdefault(key, 0.0)  # a parent is listed before its children
        self._open.append(name)
        t0 = self._clock()
        try:
            yield
            if device is not None and getattr(device, "type", None) == "cuda":
                import torch
                torch.cuda.synchronize(device)
        finally:
            self._open.pop()
            self.seconds[key] = self.seconds.get(key, 0.0) + self._clock() - t0

    def overlapped(self, name: str, seconds: float) -> None:
        """Record `seconds` that phase `name` ran in another thread, beside the phases here (as
        name + OVERLAPPED, a top-level phase outside the sums)."""
        if "/" in name or "=" in name or " " in name:
            raise ValueError(f"a start-up phase name has no '/', '=' or space: {name!r}")
        if self._begun is None:
            self._begun = self._clock()
        key = name + OVERLAPPED
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds

    def summary(self) -> dict[str, float]:
        """Every phase, each level's `other`, and `total` (pre_engine + the time since begin)."""
        out: dict[str, float] = {}
        elapsed = self._clock() - self._begun if self._begun is not None else 0.0
        top = {k: v for k, v in self.seconds.items() if "/" not in k}
        for key, secs in top.items():
            out[key] = secs
            nested = {k: v for k, v in self.seconds.items() if k.startswith(key + "/")}
            if nested:
                out.update(nested)
                direct = sum(v for k, v in nested.items() if k.count("/") == 1)
                out[key + "/other"] = max(0.0, secs - direct)
        timed = sum(v for k, v in top.items()
                    if k != "pre_engine" and not k.endswith(OVERLAPPED))
        out["other"] = max(0.0, elapsed - timed)
        out["total"] = top.get("pre_engine", 0.0) + elapsed
        return out

    @staticmethod
    def line(summary: dict[str, float]) -> str:
        """The one log line of a summary: LINE_PREFIX, then name=seconds pairs."""
        return LINE_PREFIX + " " + " ".join(f"{k}={v:.2f}" for k, v in summary.items())

    def finish(self, where: str = "") -> dict[str, float]:
        """Log the line (tagged with `where`), forget the phases, and return the summary."""
        self.take_pre_engine()
        summary = self.summary()
        # the line shows the very figures returned (a second reading of the clock would not)
        logger.info("%s%s", self.line(summary), f" [{where}]" if where else "")
        self.seconds.clear()
        self._open.clear()
        self._begun = None
        self._active = False
        return summary


def parse_line(text: str) -> dict[str, float] | None:
    """The phases of a log line written by StartupPhases.line(), or None if it holds none."""
    if LINE_PREFIX not in text:
        return None
    out: dict[str, float] = {}
    for token in text.split(LINE_PREFIX, 1)[1].split():
        name, eq, value = token.partition("=")
        if not eq:
            continue
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


# One per process: start-up happens once per process (a test process builds engines one by one).
STARTUP = StartupPhases()
