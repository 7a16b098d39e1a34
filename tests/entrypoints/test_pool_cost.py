"""benchmarks/pool_cost.py: its executors and prompts behave as the comparison needs, and (slow)
a short run through `peregrine serve` with the demo model on the CPU measures both modes."""
from __future__ import annotations

import json
import math
import threading

import pytest

from benchmark_scripts import load

pool_cost = load("pool_cost")


def test_inline_executor_runs_the_call_in_the_calling_thread():
    ex = pool_cost.InlineExecutor()
    future = ex.submit(lambda a, b=0: (threading.get_ident(), a + b), 2, b=3)
    assert future.done() and future.result() == (threading.get_ident(), 5)


def test_inline_executor_hands_an_error_to_the_future():
    future = pool_cost.InlineExecutor().submit(int, "not a number")
    assert future.done()
    with pytest.raises(ValueError, match="not a number"):
        future.result()


def test_timed_executor_counts_calls_and_reset_clears_them():
    ex = pool_cost.TimedExecutor(pool_cost.InlineExecutor())
    assert [ex.submit(len, "abc").result() for _ in range(3)] == [3, 3, 3]
    with pytest.raises(TypeError):
        ex.submit(len, 5).result()
    assert ex.stats()["calls"] == 4  # a failed call is counted too
    ex.reset()
    assert ex.stats()["calls"] == 0


def test_text_prompts_have_the_asked_lengths_and_no_shared_start():
    from transformers import AutoTokenizer

    from peregrine.demo import demo_model_path
    tok = AutoTokenizer.from_pretrained(str(demo_model_path()), local_files_only=True)
    reqs = pool_cost.text_requests(tok, 20, 40, 10, 0.1, seed=0, files=("textwrap.py",))
    assert len(reqs) == 20
    assert all(36 <= r.prompt_len <= 44 and 9 <= r.output_len <= 11 for r in reqs)
    assert all(isinstance(r.prompt, str) and r.prompt for r in reqs)
    # Windows at distinct offsets: no two prompts open alike (no prefix-cache hits between them).
    assert len({r.prompt[:40] for r in reqs}) == 20
    with pytest.raises(ValueError, match="range ratio"):
        pool_cost.text_requests(tok, 2, 40, 10, 1.5, seed=0, files=("textwrap.py",))
    with pytest.raises(ValueError, match="too few"):
        pool_cost.text_requests(tok, 10**6, 40, 10, 0.1, seed=0, files=("textwrap.py",))


def test_delta_is_inline_minus_pool():
    pool = {"output_tok_s": 100.0, "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0, "tpot_p50_ms": 4.0}
    inline = {"output_tok_s": 90.0, "ttft_p50_ms": 15.0, "ttft_p99_ms": 20.0, "tpot_p50_ms": 5.0}
    d = pool_cost.delta(pool, inline)
    assert d["output_tok_s"] == -10.0 and d["output_tok_s_pct"] == pytest.approx(-10.0)
    assert d["ttft_p50_ms"] == 5.0 and d["ttft_p50_ms_pct"] == pytest.approx(50.0)
    assert d["ttft_p99_ms"] == 0.0 and d["tpot_p50_ms_pct"] == pytest.approx(25.0)


@pytest.mark.slow
def test_short_run_measures_both_modes_through_the_server(tmp_path):
    out = tmp_path / "pool.json"
    result = pool_cost.main([
        "--json", str(out), "--num-prompts", "6", "--finite-prompts", "4",
        "--warmup-prompts", "2", "--input-len", "24", "--output-len", "4", "--rates", "inf", "50",
        "--", "--max-model-len", "128", "--max-num-seqs", "8"])
    assert json.loads(out.read_text())["rates"].keys() == {"inf", "50"}
    for rate, num in (("inf", 6), ("50", 4)):
        runs = result["rates"][rate]
        for mode in pool_cost.MODES:
            row = runs[mode]
            assert row["successful"] == num and row["failed"] == 0, (rate, mode, row)
            assert row["output_tok_s"] > 0 and row["tpot_p50_ms"] > 0
            # Every prompt was tokenized by the executor of the mode being measured.
            assert row["preprocess"]["calls"] == num, (rate, mode, row["preprocess"])
        d = runs["delta_inline_minus_pool"]
        assert d["output_tok_s"] == pytest.approx(
            runs["inline"]["output_tok_s"] - runs["pool"]["output_tok_s"])
        assert not math.isnan(d["ttft_p50_ms_pct"])
