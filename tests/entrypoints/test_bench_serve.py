"""`peregrine bench serve` against a live server (fake engine), and its datasets."""
from __future__ import annotations

import json
import math

import pytest

from fake_engine import FakeEngine
from peregrine.bench.datasets import prefix_shared_dataset, random_dataset
from peregrine.bench.serve import RequestResult, main, summarize
from server_utils import RunningServer


def test_random_dataset_lengths_stay_in_the_documented_spread():
    reqs = random_dataset(200, 200, 180, 0.1, vocab_size=1000, seed=0)
    assert all(180 <= r.prompt_len <= 220 and 162 <= r.output_len <= 198 for r in reqs)
    assert all(10 <= t < 1000 for r in reqs for t in r.prompt)
    assert len({r.prompt_len for r in reqs}) > 10
    assert random_dataset(5, 20, 5, 0.1, 1000, seed=3) == random_dataset(5, 20, 5, 0.1, 1000, seed=3)


def test_prefix_shared_dataset_shares_exactly_the_prefix():
    reqs = prefix_shared_dataset(4, 50, 10, 7, vocab_size=500, seed=1)
    assert all(r.prompt_len == 60 and r.output_len == 7 for r in reqs)
    assert len({tuple(r.prompt[:50]) for r in reqs}) == 1
    assert len({tuple(r.prompt[50:]) for r in reqs}) == 4


def test_bad_dataset_arguments_raise():
    with pytest.raises(ValueError):
        random_dataset(1, 0, 5, 0.1, 100, 0)
    with pytest.raises(ValueError):
        random_dataset(1, 5, 5, 1.5, 100, 0)
    with pytest.raises(ValueError):
        prefix_shared_dataset(1, 5, 5, 5, vocab_size=5, seed=0)


def test_summary_percentiles_and_throughput():
    results = [RequestResult(10, 5, True, ttft=0.1 * (i + 1), latency=1.0, itl=[0.2] * 4)
               for i in range(10)] + [RequestResult(10, error="boom")]
    s = summarize(results, duration=2.0)
    assert (s["successful_requests"], s["failed_requests"]) == (10, 1)
    assert s["request_throughput"] == 5.0 and s["output_throughput"] == 25.0
    assert s["total_token_throughput"] == 75.0
    assert s["ttft_ms"]["p99"] == pytest.approx(1000.0)
    assert s["ttft_ms"]["median"] == pytest.approx(550.0)
    assert s["itl_ms"]["mean"] == pytest.approx(200.0)
    assert s["errors"] == ["boom"]


@pytest.mark.parametrize("rate,dataset", [("inf", "random"), ("200", "prefix-shared")])
def test_bench_against_a_live_server_writes_json(tmp_path, capsys, rate, dataset):
    engine = FakeEngine(max_model_len=256)
    out = tmp_path / "result.json"
    with RunningServer(engine) as s:
        code = main(["--base-url", s.base_url, "--dataset", dataset, "--num-prompts", "12",
                     "--request-rate", rate, "--max-concurrency", "4", "--random-input-len", "20",
                     "--random-output-len", "6", "--prefix-len", "30", "--suffix-len", "5",
                     "--output-len", "4", "--vocab-size", "500", "--result-file", str(out),
                     "--save-detailed"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Successful requests:" in printed and "TTFT (ms)" in printed
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert summary["successful_requests"] == 12 and summary["failed_requests"] == 0
    expected = 12 * 4 if dataset == "prefix-shared" else None
    if expected is not None:
        assert summary["total_output_tokens"] == expected
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(summary[key]) == {"mean", "median", "p99"}
        assert summary[key]["p99"] >= summary[key]["median"] >= 0
    assert summary["model"] == "fake-model"
    assert data["config"]["request_rate"] == ("inf" if rate == "inf" else float(rate))
    assert not math.isnan(summary["output_throughput"])
    server = summary["server"]
    assert server["time_to_first_token_mean_ms"] > 0  # from the server's /metrics
    assert "Server means (ms)" in printed
    rows = data["requests"]
    assert len(rows) == 12 and all(r["success"] and r["error"] == "" for r in rows)
    assert min(r["sent_ms"] for r in rows) == 0.0
    for r in rows:
        assert 0 < r["ttft_ms"] <= r["latency_ms"]
        # NOTE: at most one streamed chunk per token (tokens the client has not read yet are
        # merged into one chunk), so a request has at most output_len - 1 gaps.
        assert 0 <= len(r["itl_ms"]) <= r["output_len"] - 1


def test_bench_counts_failures(tmp_path):
    with RunningServer(FakeEngine(max_model_len=32)) as s:
        # Prompts longer than max_model_len are refused with 400: every request fails.
        code = main(["--base-url", s.base_url, "--num-prompts", "3", "--random-input-len", "40",
                     "--random-output-len", "4", "--vocab-size", "500",
                     "--result-file", str(tmp_path / "r.json")])
    assert code == 1
    summary = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert summary["failed_requests"] == 3 and "400" in summary["errors"][0]


def test_vocab_size_is_read_from_the_server_when_not_given(tmp_path):
    engine = FakeEngine(max_model_len=256)
    out = tmp_path / "r.json"
    with RunningServer(engine) as s:
        code = main(["--base-url", s.base_url, "--num-prompts", "3", "--random-input-len", "8",
                     "--random-output-len", "3", "--result-file", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["config"]["vocab_size"] == engine.config.model.vocab_size != 32000
    assert data["summary"]["successful_requests"] == 3


def test_vocab_size_from_the_model_card_wins(monkeypatch):
    import asyncio

    from peregrine.bench import serve as bench_serve

    async def card(ep, path, headers=None):
        assert path == "/v1/models"
        return {"data": [{"id": "other", "vocab_size": 7}, {"id": "m", "vocab_size": 1234}]}

    monkeypatch.setattr(bench_serve, "get_json", card)
    assert asyncio.run(bench_serve.served_vocab_size("http://127.0.0.1:1", "m")) == 1234
    with pytest.raises(ValueError, match="serves no model 'x'"):
        asyncio.run(bench_serve.served_vocab_size("http://127.0.0.1:1", "x"))
