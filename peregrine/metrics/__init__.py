"""Serving metrics: Prometheus export and a periodic log line."""
from __future__ import annotations

from peregrine.metrics.prometheus import METRIC_NAMES, ServerMetrics
from peregrine.metrics.stat_logger import StatLogger, format_stats_line

__all__ = ["METRIC_NAMES", "ServerMetrics", "StatLogger", "format_stats_line"]
