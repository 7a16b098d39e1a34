"""Speculative decoding in the stats line and EngineStats' derived rates."""
from __future__ import annotations

from peregrine.engine.stats import EngineStats
from peregrine.metrics.stat_logger import format_stats_line


def test_stats_line_shows_acceptance_over_the_interval() -> None:
    prev = EngineStats(spec_num_drafts=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=20)
    cur = EngineStats(spec_num_drafts=30, spec_num_draft_tokens=120, spec_num_accepted_tokens=50)
    line = format_stats_line(prev, cur, 1.0)
    # 30 of 80 drafts accepted over 20 verify steps: 37.5%, 1 + 30 / 20 = 2.50 tokens per step
    assert line.endswith("draft acceptance rate: 37.5%, mean acceptance length: 2.50")
    assert "acceptance" not in format_stats_line(cur, cur, 1.0)


def test_derived_rates() -> None:
    st = EngineStats(spec_num_drafts=4, spec_num_draft_tokens=16, spec_num_accepted_tokens=6)
    assert st.spec_acceptance_rate == 6 / 16
    assert st.spec_mean_acceptance_length == 2.5
    assert EngineStats().spec_mean_acceptance_length == 0.0
    assert EngineStats().spec_acceptance_rate == 0.0
