"""Start-up phase timings: nesting, the `other` remainder, the log line and its parser."""
from __future__ import annotations

import logging
import os
import time

import pytest

from peregrine.startup_timing import LINE_PREFIX, StartupPhases, parse_line, process_age


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _phases(age: float | None = 3.0) -> tuple[StartupPhases, FakeClock]:
    clock = FakeClock()
    return StartupPhases(clock=clock, age=lambda: age), clock


def test_phases_nest_and_each_level_adds_up_to_its_parent() -> None:
    p, clock = _phases(age=3.0)
    p.begin()
    with p.phase("config"):
        clock.advance(0.5)
    with p.phase("engine_core"):
        clock.advance(0.25)
        with p.phase("model"):
            clock.advance(2.0)
        with p.phase("graphs"):
            clock.advance(1.0)
    clock.advance(0.125)
    s = p.summary()
    assert list(s) == ["pre_engine", "config", "engine_core", "engine_core/model",
                       "engine_core/graphs", "engine_core/other", "other", "total"]
    assert s["pre_engine"] == 3.0 and s["config"] == 0.5
    assert s["engine_core"] == pytest.approx(3.25)
    assert s["engine_core/other"] == pytest.approx(0.25)
    assert s["other"] == pytest.approx(0.125)
    assert s["total"] == pytest.approx(3.0 + 0.5 + 3.25 + 0.125)


def test_the_time_before_the_engine_is_counted_once_per_process() -> None:
    p, clock = _phases(age=2.0)
    p.begin()
    with p.phase("config"):
        clock.advance(1.0)
    assert p.finish()["pre_engine"] == 2.0
    p.begin()  # a second engine in the same process
    with p.phase("config"):
        clock.advance(1.0)
    s = p.finish()
    assert "pre_engine" not in s and s["total"] == pytest.approx(1.0)


def test_begin_with_join_keeps_the_phases_of_a_start_up_in_progress() -> None:
    p, clock = _phases()
    p.begin()
    with p.phase("config"):
        clock.advance(1.0)
    p.begin(join=True)
    assert p.active and p.seconds["config"] == 1.0
    p.finish()
    assert not p.active
    p.begin(join=True)
    assert "config" not in p.seconds


def test_a_repeated_phase_adds_up() -> None:
    p, clock = _phases()
    for _ in range(3):
        with p.phase("step"):
            clock.advance(0.5)
    assert p.summary()["step"] == pytest.approx(1.5)


def test_a_failing_block_is_still_timed_and_closed() -> None:
    p, clock = _phases()
    with pytest.raises(RuntimeError):
        with p.phase("model"):
            clock.advance(1.0)
            raise RuntimeError("boom")
    with p.phase("next"):
        clock.advance(1.0)
    assert p.seconds == {"model": 1.0, "next": 1.0}  # next is not nested under model


def test_phase_names_that_would_break_the_line_are_refused() -> None:
    p, _ = _phases()
    for bad in ("a/b", "a=b", "a b"):
        with pytest.raises(ValueError, match="phase name"):
            with p.phase(bad):
                pass


def test_an_overlapped_phase_is_listed_but_left_out_of_the_sums() -> None:
    p, clock = _phases(age=1.0)
    p.begin()
    with p.phase("engine_core"):
        clock.advance(2.0)
    p.overlapped("tokenizer", 1.5)  # ran in a thread during engine_core
    clock.advance(0.25)
    s = p.summary()
    assert s["tokenizer_overlapped"] == 1.5
    assert s["other"] == pytest.approx(0.25)
    assert s["total"] == pytest.approx(3.25)
    with pytest.raises(ValueError, match="phase name"):
        p.overlapped("a b", 1.0)


def test_finish_logs_one_line_that_parse_line_reads_back(caplog) -> None:
    p, clock = _phases(age=1.5)
    p.begin()
    with p.phase("tokenizer"):
        clock.advance(0.75)
    with caplog.at_level(logging.INFO, logger="peregrine"):
        summary = p.finish("worker rank 0, pid 7")
    lines = [r.getMessage() for r in caplog.records if LINE_PREFIX in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith("[worker rank 0, pid 7]")
    assert parse_line("2026-12-01 INFO peregrine: " + lines[0]) == pytest.approx(summary)
    assert parse_line("INFO peregrine: KV cache: 12 blocks") is None


def test_the_logged_line_shows_the_figures_finish_returns(caplog) -> None:
    """The clock moves at every reading: a line made from a second reading would show a
    larger total and `other` than the summary returned."""
    clock = FakeClock()

    def ticking() -> float:
        clock.advance(0.25)
        return clock.now

    p = StartupPhases(clock=ticking, age=lambda: None)
    p.begin()
    with p.phase("model"):
        pass
    with caplog.at_level(logging.INFO, logger="peregrine"):
        summary = p.finish()
    lines = [r.getMessage() for r in caplog.records if LINE_PREFIX in r.getMessage()]
    assert len(lines) == 1
    assert parse_line(lines[0]) == pytest.approx(summary, abs=0.006)
    assert summary["total"] == pytest.approx(0.75) and summary["other"] == pytest.approx(0.5)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux's /proc")
def test_process_age_is_the_time_since_this_process_started() -> None:
    age = process_age()
    assert age is not None and 0.0 < age < time.clock_gettime(time.CLOCK_BOOTTIME)
    time.sleep(0.05)
    later = process_age()
    assert later is not None and later >= age + 0.03
