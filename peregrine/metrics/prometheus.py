"""Prometheus metrics for the OpenAI server: engine gauges/counters read at scrape time from the
latest EngineStats, and per-request latency histograms fed by AsyncEngine as outputs arrive."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from peregrine.engine.stats import EngineStats
from peregrine.outputs import RequestOutput

PREFIX = "peregrine_"
FINISHED_REASONS = ("stop", "length", "abort", "error")

# NOTE: bucket edges in seconds, dense where a healthy server lives, sparse in the long tail.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0,
                 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
                    45.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Every metric name this module exports (histograms add _bucket/_sum/_count, counters _total).
METRIC_NAMES = (
    "peregrine_num_requests_running",
    "peregrine_num_requests_waiting",
    "peregrine_kv_cache_usage_ratio",
    "peregrine_prefix_cache_queries_total",
    "peregrine_prefix_cache_hits_total",
    "peregrine_num_preemptions_total",
    "peregrine_num_requests_swapped",
    "peregrine_cpu_cache_usage_ratio",
    "peregrine_num_swap_outs_total",
    "peregrine_num_swap_ins_total",
    "peregrine_prompt_tokens_total",
    "peregrine_generation_tokens_total",
    "peregrine_request_success_total",
    "peregrine_time_to_first_token_seconds",
    "peregrine_inter_token_latency_seconds",
    "peregrine_request_time_per_output_token_seconds",
    "peregrine_e2e_request_latency_seconds",
    "peregrine_request_queue_time_seconds",
    "peregrine_request_prefill_time_seconds",
    "peregrine_request_decode_time_seconds",
)


class _StatsCollector:
    """Reads the engine's snapshot at scrape time, so the step loop never touches Prometheus."""

    def __init__(self, model_name: str, stats_fn: Callable[[], EngineStats]) -> None:
        self._model_name = model_name
        self._stats_fn = stats_fn

    def describe(self) -> list[Metric]:
        return []  # NOTE: unchecked registration; values only exist at collect time

    def collect(self) -> Iterator[Metric]:
        s = self._stats_fn()
        labels = ["model_name"]
        values = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            m = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            m.add_metric(values, value)
            return m

        def counter(name: str, doc: str, value: float) -> Metric:
            m = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            m.add_metric(values, value)
            return m

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).",
                    s.kv_cache_usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.prefix_cache_hits)
        yield counter("num_preemptions", "Preemptions of running requests.", s.num_preemptions)
        yield gauge("num_requests_swapped", "Preempted requests whose KV blocks are in CPU swap "
                    "space.", s.num_swapped)
        yield gauge("cpu_cache_usage_ratio", "Fraction of CPU swap blocks in use (0..1).",
                    s.cpu_cache_usage)
        yield counter("num_swap_outs", "Preemptions that copied a request's KV blocks to the CPU.",
                      s.num_swapped_out)
        yield counter("num_swap_ins", "Swapped requests copied back and resumed.",
                      s.num_swapped_in)
        yield counter("prompt_tokens", "Prompt tokens processed (prefill).", s.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens_total)
        # vLLM's names; mean acceptance length = 1 + accepted_tokens / num_drafts.
        yield counter("spec_decode_num_drafts", "Speculative verify steps (one per request "
                      "verified).", s.spec_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.",
                      s.spec_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      s.spec_num_accepted_tokens)


@dataclass
class _RequestTimes:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


class ServerMetrics:
    """Prometheus metrics of one served model (own registry); an AsyncEngine RequestObserver.

    Expects DELTA outputs: the tokens in each RequestOutput are the new ones since the last.
    """

    def __init__(self, model_name: str, stats_fn: Callable[[], EngineStats],
                 registry: CollectorRegistry | None = None) -> None:
        # NOTE: *_created series double the exposition for no use here (process-wide setting).
        disable_created_metrics()
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(_StatsCollector(model_name, stats_fn))
        lbl = ["model_name"]
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finished_reason.",
            lbl + ["finished_reason"], registry=self.registry)
        for reason in FINISHED_REASONS:
            self.request_success.labels(model_name, reason)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              lbl, buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between tokens.",
                             lbl, buckets=_TOKEN_BUCKETS, registry=self.registry).labels(model_name)
        self.tpot = Histogram(
            PREFIX + "request_time_per_output_token_seconds",
            "Per request: (last token time - first token time) / (output tokens - 1).",
            lbl, buckets=_TOKEN_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish.",
                             lbl, buckets=_REQUEST_BUCKETS, registry=self.registry).labels(model_name)
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "Arrival to first scheduling.",
            lbl, buckets=_REQUEST_BUCKETS, registry=self.registry).labels(model_name)
        self.prefill_time = Histogram(
            PREFIX + "request_prefill_time_seconds", "First scheduling to first token (engine).",
            lbl, buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.decode_time = Histogram(
            PREFIX + "request_decode_time_seconds", "First token to last token (engine).",
            lbl, buckets=_REQUEST_BUCKETS, registry=self.registry).labels(model_name)
        self._requests: dict[str, _RequestTimes] = {}

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # ------------------------------------------------------------ RequestObserver
    def on_request_added(self, request_id: str, arrival_time: float) -> None:
        self._requests[request_id] = _RequestTimes(arrival_time)

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            times = self._requests.get(out.request_id)
            if times is None:
                continue
            new_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
            if new_tokens:
                if times.first_token is None:
                    times.first_token = now
                    self.ttft.observe(now - times.arrival)
                    # NOTE: tokens beyond the first in one step arrived together; no ITL sample.
                else:
                    self.itl.observe((now - times.last_token) / new_tokens)
                times.last_token = now
                times.num_tokens += new_tokens
            if out.finished:
                self._finish(out, times, now)

    def on_request_aborted(self, request_id: str, now: float) -> None:
        if self._requests.pop(request_id, None) is not None:
            self.request_success.labels(self.model_name, "abort").inc()

    def _finish(self, out: RequestOutput, times: _RequestTimes, now: float) -> None:
        del self._requests[out.request_id]
        reasons = [c.finish_reason for c in out.outputs]
        if out.error is not None or "error" in reasons:
            reason = "error"
        else:
            reason = next((r for r in reasons if r), "stop")
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e.observe(now - times.arrival)
        if times.first_token is not None and times.num_tokens > 1:
            self.tpot.observe((times.last_token - times.first_token) / (times.num_tokens - 1))
        m = out.metrics
        if m is None or m.first_scheduled_time is None:
            return
        self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.first_token_time is not None:
            self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
            if m.last_token_time is not None:
                self.decode_time.observe(max(0.0, m.last_token_time - m.first_token_time))
