"""The periodic stats log line."""
from __future__ import annotations

import logging

import pytest

from peregrine.engine.stats import EngineStats
from peregrine.metrics import StatLogger, format_stats_line


def test_line_has_rates_queues_kv_and_hit_rate():
    prev = EngineStats(prompt_tokens_total=100, generation_tokens_total=10,
                       prefix_cache_queries=100, prefix_cache_hits=0)
    cur = EngineStats(num_running=3, num_waiting=1, kv_cache_usage=0.125,
                      prompt_tokens_total=300, generation_tokens_total=60,
                      prefix_cache_queries=300, prefix_cache_hits=150)
    line = format_stats_line(prev, cur, 2.0)
    assert "prompt throughput: 100.0 tokens/s" in line
    assert "generation throughput: 25.0 tokens/s" in line
    assert "running: 3 reqs" in line and "waiting: 1 reqs" in line
    assert "KV cache usage: 12.5%" in line
    assert "prefix cache hit rate: 75.0%" in line  # 150 hits of 200 queries in the interval


def test_hit_rate_falls_back_to_lifetime_without_lookups():
    s = EngineStats(prefix_cache_queries=10, prefix_cache_hits=5)
    assert "prefix cache hit rate: 50.0%" in format_stats_line(s, s, 1.0)


def test_idle_engine_logs_once_then_stays_quiet(caplog):
    state = {"s": EngineStats()}
    log = logging.getLogger("test.stats")
    logger = StatLogger(lambda: state["s"], interval=1.0, log=log)
    with caplog.at_level(logging.INFO, logger="test.stats"):
        assert logger.log_once(now=1e9) is None  # idle from the start: nothing
        state["s"] = EngineStats(num_running=1, generation_tokens_total=5)
        assert logger.log_once(now=1e9 + 1) is not None
        state["s"] = EngineStats(generation_tokens_total=9)
        assert logger.log_once(now=1e9 + 2) is not None  # activity in this interval
        assert logger.log_once(now=1e9 + 3) is not None  # first idle interval: one line
        assert logger.log_once(now=1e9 + 4) is None
    assert len(caplog.records) == 3


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval"):
        StatLogger(lambda: EngineStats(), interval=0)
