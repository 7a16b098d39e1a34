"""benchmarks/soak.py: its checks flag what they must, a soak against the fake engine passes,
and (slow) a short soak of `peregrine serve` with the demo model on the CPU passes."""
from __future__ import annotations

import asyncio
import json

import pytest

from benchmark_scripts import load
from fake_engine import FakeEngine
from server_utils import RunningServer

soak = load("soak")


def _round(k: int, **kw) -> soak.RoundResult:
    r = soak.RoundResult(k, requests=10, completed=10, rss_mib=1000.0, gpu_mib=2000.0,
                         gauges_after={name: 0.0 for name in soak._GAUGES})
    for name, value in kw.items():
        setattr(r, name, value)
    return r


def _check(rounds, canaries=None):
    canaries = canaries or [{0: "x"} for _ in rounds]
    return soak.check_rounds(rounds, canaries, rss_tolerance_mib=64, rss_tolerance_frac=0.05,
                             gpu_tolerance_mib=128, baseline_round=1)


def test_clean_rounds_pass_the_checks():
    # RSS within max(64 MiB, 5%) of round 1, GPU within 128 MiB: flat enough.
    assert _check([_round(1), _round(2, rss_mib=1049.0), _round(3, gpu_mib=2128.0)]) == []


@pytest.mark.parametrize("field,value,words", [
    ("status_5xx", 1, "5xx"), ("client_errors", 2, "client errors"),
    ("unexpected_status", 1, "unexpected statuses"), ("server_tracebacks", 1, "tracebacks"),
    ("gauges_after", {"peregrine_num_requests_running": 1.0}, "gauges not back to 0"),
    ("rss_mib", 1065.0, "RSS"), ("gpu_mib", 2129.0, "GPU memory"),
])
def test_each_broken_invariant_is_reported(field, value, words):
    failures = _check([_round(1), _round(2, **{field: value})])
    assert len(failures) == 1 and words in failures[0] and "round 2" in failures[0], failures


def test_a_canary_that_changes_is_reported():
    rounds = [_round(1), _round(2), _round(3)]
    failures = _check(rounds, [{0: "a", 1: "b"}, {0: "a", 1: "b"}, {0: "a", 1: "c"}])
    assert failures == ["round 3: canaries [1] differ from round 1"]
    assert rounds[2].canary_mismatches == 1


def test_gauges_are_read_from_the_exposition():
    text = ('# HELP peregrine_num_requests_running x\n'
            'peregrine_num_requests_running{model_name="m"} 3.0\n'
            'peregrine_num_requests_waiting{model_name="m"} 0.0\n'
            'peregrine_num_requests_running_other 7.0\n')
    assert soak.read_gauges(text) == {"peregrine_num_requests_running": 3.0,
                                      "peregrine_num_requests_waiting": 0.0}


@pytest.mark.parametrize("kind", soak.MALFORMED_KINDS)
def test_malformed_requests_are_what_they_say(kind):
    path, body = soak.malformed_request(kind, "m", 100)
    assert path.startswith("/v1/")
    if kind == "bad_json":
        with pytest.raises(json.JSONDecodeError):
            json.loads(body)
        return
    parsed = json.loads(body)
    if kind == "oversize_prompt":
        assert len(parsed["prompt"]) == 101
    elif kind == "lone_surrogate":
        assert "\ud800" in parsed["prompt"]
    elif kind == "wrong_type":
        assert isinstance(parsed["max_tokens"], str)
    elif kind == "unknown_field":
        assert "no_such_field" in parsed


def test_bad_arguments_are_refused():
    for argv in (["--rounds", "0"], ["--abort-fraction", "0.9", "--malformed-fraction", "0.2"],
                 ["--server-pid", "1"], ["--url", "http://x", "--", "model"]):
        with pytest.raises(SystemExit):
            soak.parse_args(argv)


@pytest.mark.slow  # (a few seconds of load)
def test_a_soak_of_the_fake_engine_passes():
    args, _ = soak.parse_args(["--rounds", "2", "--requests", "80", "--max-tokens", "6",
                               "--drain-timeout", "10"])
    with RunningServer(FakeEngine(max_num_seqs=128)) as s:
        result = asyncio.run(soak.soak(args, s.base_url, None, None))
    assert result["failures"] == [] and result["passed"]
    rounds = result["rounds"]
    for r in rounds:
        assert r["completed"] + r["aborted"] + r["malformed_4xx"] == r["requests"], r
    # NOTE: seeded, so the mix is the same every run; each kind of request shows up.
    assert sum(r["aborted"] for r in rounds) > 0 and sum(r["malformed_4xx"] for r in rounds) > 0
    assert len(result["canary_texts"]) == 4 and all(result["canary_texts"].values())


def test_memory_is_compared_with_the_baseline_round():
    rounds = [_round(1, rss_mib=500.0), _round(2), _round(3, rss_mib=1060.0)]
    assert _check(rounds) != []  # against round 1's 500 MiB
    assert soak.check_rounds(rounds, [{}] * 3, rss_tolerance_mib=64, rss_tolerance_frac=0.05,
                             gpu_tolerance_mib=128, baseline_round=2) == []


@pytest.mark.slow
def test_a_short_soak_of_the_demo_model_server_passes(tmp_path):
    # NOTE: a small KV pool, so the first round touches all of it (the CPU pool pages in as it
    # is used). On the CPU the server's RSS still rises for a few rounds, by 20-50 MiB a round
    # and less each time (native memory: Python's heap stays flat under tracemalloc), so memory
    # is compared with round 2's; rounds 3 and 4 rose by at most 73 MiB over it in nine runs.
    # 4 rounds of 60 requests (12 aborted, 3 malformed on average).
    result = soak.main(["--rounds", "4", "--requests", "60", "--max-tokens", "16",
                        "--baseline-round", "2", "--rss-tolerance-mib", "128",
                        "--json", str(tmp_path / "soak.json"),
                        "--", "--max-num-seqs", "64", "--num-gpu-blocks-override", "256",
                        "--block-size", "16"])
    assert result["failures"] == [], (result["failures"], [r["samples"] for r in result["rounds"]])
    written = json.loads((tmp_path / "soak.json").read_text())
    assert written["passed"] and len(written["rounds"]) == 4
    for r in written["rounds"]:
        assert r["status_5xx"] == r["client_errors"] == r["unexpected_status"] == 0, r
        assert r["completed"] + r["aborted"] + r["malformed_4xx"] == r["requests"], r
        assert r["rss_mib"] is not None and r["server_tracebacks"] == 0, r
