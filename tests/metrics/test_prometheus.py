"""ServerMetrics: names, labels, stats read at scrape time, per-request histograms."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from peregrine.engine.stats import EngineStats
from peregrine.metrics import METRIC_NAMES, ServerMetrics
from peregrine.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render()[0].decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _out(rid: str, ntok: int, finished: bool = False, reason: str | None = None,
         metrics: RequestMetrics | None = None, error: str | None = None) -> RequestOutput:
    comp = CompletionOutput(0, "x" * ntok, list(range(ntok)), finish_reason=reason)
    return RequestOutput(rid, None, [1, 2], [comp], finished, metrics=metrics, error=error)


def test_every_name_is_exposed_with_prefix_and_model_label():
    m = ServerMetrics("my-model", lambda: EngineStats())
    text = m.render()[0].decode()
    for name in METRIC_NAMES:
        assert name in text, name
    assert ":" not in "".join(line.split("{")[0] for line in text.splitlines()
                              if not line.startswith("#"))
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith("peregrine_")
        for s in fam.samples:
            assert s.labels.get("model_name") == "my-model"


def test_engine_stats_are_read_at_scrape_time():
    stats = {"s": EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25,
                              prefix_cache_queries=100, prefix_cache_hits=40, num_preemptions=1,
                              prompt_tokens_total=500, generation_tokens_total=70,
                              num_swapped_out=4, num_swapped_in=3, num_swapped=1,
                              cpu_cache_usage=0.125)}
    m = ServerMetrics("m", lambda: stats["s"])
    lbl = (("model_name", "m"),)
    got = _samples(m)
    assert got[("peregrine_num_requests_running", lbl)] == 3
    assert got[("peregrine_num_requests_waiting", lbl)] == 2
    assert got[("peregrine_kv_cache_usage_ratio", lbl)] == 0.25
    assert got[("peregrine_prefix_cache_queries_total", lbl)] == 100
    assert got[("peregrine_prefix_cache_hits_total", lbl)] == 40
    assert got[("peregrine_num_preemptions_total", lbl)] == 1
    assert got[("peregrine_prompt_tokens_total", lbl)] == 500
    assert got[("peregrine_generation_tokens_total", lbl)] == 70
    assert got[("peregrine_num_swap_outs_total", lbl)] == 4
    assert got[("peregrine_num_swap_ins_total", lbl)] == 3
    assert got[("peregrine_num_requests_swapped", lbl)] == 1
    assert got[("peregrine_cpu_cache_usage_ratio", lbl)] == 0.125
    stats["s"] = EngineStats()
    assert _samples(m)[("peregrine_num_requests_running", lbl)] == 0


def test_request_latencies_are_observed():
    m = ServerMetrics("m", lambda: EngineStats())
    rm = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=10.75,
                        last_token_time=11.5)
    m.on_request_added("r", 10.0)
    m.on_outputs([_out("r", 1, metrics=rm)], now=11.0)  # TTFT 1.0
    m.on_outputs([_out("r", 1, metrics=rm)], now=11.2)  # ITL 0.2
    m.on_outputs([_out("r", 2, True, "length", rm)], now=11.6)  # ITL 0.2 per token
    got = _samples(m)
    lbl = (("model_name", "m"),)
    assert got[("peregrine_time_to_first_token_seconds_sum", lbl)] == 1.0
    assert got[("peregrine_inter_token_latency_seconds_count", lbl)] == 2
    assert abs(got[("peregrine_inter_token_latency_seconds_sum", lbl)] - 0.4) < 1e-9
    # TPOT = (11.6 - 11.0) / (4 - 1)
    assert abs(got[("peregrine_request_time_per_output_token_seconds_sum", lbl)] - 0.2) < 1e-9
    assert got[("peregrine_e2e_request_latency_seconds_sum", lbl)] == pytest.approx(1.6)
    assert got[("peregrine_request_queue_time_seconds_sum", lbl)] == pytest.approx(0.5)
    assert got[("peregrine_request_prefill_time_seconds_sum", lbl)] == pytest.approx(0.25)
    assert got[("peregrine_request_decode_time_seconds_sum", lbl)] == pytest.approx(0.75)
    key = ("peregrine_request_success_total", (("finished_reason", "length"), ("model_name", "m")))
    assert got[key] == 1


def test_finished_reasons_are_counted_separately():
    m = ServerMetrics("m", lambda: EngineStats())
    for rid in ("a", "b", "c"):
        m.on_request_added(rid, 0.0)
    m.on_outputs([_out("a", 1, True, "stop")], 1.0)
    m.on_outputs([_out("b", 0, True, "error", error="boom")], 1.0)
    m.on_request_aborted("c", 1.0)
    m.on_request_aborted("unknown", 1.0)  # not ours: not counted
    got = _samples(m)

    def count(reason: str) -> float:
        return got[("peregrine_request_success_total",
                    (("finished_reason", reason), ("model_name", "m")))]
    assert (count("stop"), count("error"), count("abort"), count("length")) == (1, 1, 1, 0)


def test_two_servers_in_one_process_do_not_collide():
    a = ServerMetrics("a", lambda: EngineStats())
    b = ServerMetrics("b", lambda: EngineStats())
    assert b"model_name=\"a\"" in a.render()[0] and b"model_name=\"a\"" not in b.render()[0]
