"""benchmarks/step_gap_probe.py's trace analysis on a made-up trace (its argument and device
checks: test_graph_replay_probe.py)."""
from __future__ import annotations

from benchmark_scripts import load


def _trace() -> list[dict]:
    """Eight graph launches 1,000 µs apart, each two kernels over 900 µs; between two graphs a
    copy and a kernel of their own launches, and after the third graph (as after a prefill's
    piece) an attention kernel too."""
    events = []
    for i in range(8):
        t0 = 1000.0 * i
        corr = 100 + i
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t0 - 50,
                       "dur": 40, "args": {"correlation": corr}})
        events.append({"ph": "X", "cat": "kernel", "name": "embed", "ts": t0, "dur": 2,
                       "args": {"correlation": corr}})
        events.append({"ph": "X", "cat": "kernel", "name": "lm_head", "ts": t0 + 650, "dur": 250,
                       "args": {"correlation": corr}})
        events.append({"ph": "X", "cat": "kernel", "name": "argmax", "ts": t0 + 905, "dur": 4,
                       "args": {"correlation": 500 + i}})
        events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": t0 + 950,
                       "dur": 1, "args": {"correlation": 600 + i}})
        if i == 2:
            events.append({"ph": "X", "cat": "kernel", "name": "attention", "ts": t0 + 920,
                           "dur": 20, "args": {"correlation": 700}})
    return events


def test_gaps_are_measured_between_graph_launches_and_the_last_gap_is_listed() -> None:
    res = load("step_gap_probe").graph_gaps(_trace(), skip=2)
    assert res["graphs"] == 6
    assert res["gap_us"] == [100.0] * 5
    assert res["step_ms"] == [1.0] * 5
    assert [(e["at_us"], e["name"]) for e in res["between_us"]] == [(5.0, "argmax"),
                                                                     (50.0, "Memcpy HtoD")]

