"""`peregrine bench latency` / `throughput` report speculative decoding when it is on."""
from __future__ import annotations

import json

import pytest

from peregrine.bench.offline import build_parser, run_latency, run_throughput
from peregrine.testing.checkpoints import tiny_checkpoint

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
KEYS = {"num_drafts", "draft_tokens", "accepted_tokens", "acceptance_rate",
        "mean_acceptance_length"}


def _args(kind: str, *extra: str):
    return build_parser(kind).parse_args(
        ["--model", str(tiny_checkpoint("llama")), "--device", "cpu", "--dtype", "float32",
         "--load-format", "auto", "--speculative-config", SPEC, *extra])


def test_latency_reports_acceptance() -> None:
    res = run_latency(_args("latency", "--input-len", "12", "--output-len", "24", "--warmup",
                            "0", "--iters", "1"))
    spec = res["speculative"]
    assert set(spec) == KEYS
    assert spec["num_drafts"] > 0 and 0 <= spec["acceptance_rate"] <= 1
    assert spec["mean_acceptance_length"] == 1 + spec["accepted_tokens"] / spec["num_drafts"]


def test_throughput_reports_acceptance() -> None:
    res = run_throughput(_args("throughput", "--num-prompts", "4", "--min-input", "8",
                               "--max-input", "16", "--min-output", "8", "--max-output", "16"))
    assert set(res["speculative"]) == KEYS


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ngram-code", "demo-self-rtn"])
def test_spec_bench_case_runs_on_the_cpu(case: str) -> None:
    import argparse
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import spec_bench
    ns = argparse.Namespace(k=3, lookup_min=2, lookup_max=3, draft_k=2, fp32=False,
                            output_len=6, num_prompts=1, batches=[1, 2])
    res = spec_bench.run_case(case, ns, device="cpu", dtype="float32")
    spec = res["spec_config"]
    if case == "ngram-code":
        assert (spec["num_speculative_tokens"], spec["prompt_lookup_min"],
                spec["prompt_lookup_max"]) == (3, 2, 3)
    else:
        assert (spec["num_speculative_tokens"], spec["quantization"]) == (2, "rtn")
        assert res["spec"]["num_drafts"] > 0  # a draft model proposes at every step
    assert res["same_tokens_as_plain"] == 1.0
    assert set(res["sweep_speedup"]) == {1, 2}
    assert res["predicted_speedup"] > 0 and res["spec"]["num_drafts"] >= 0
    assert res["plain_sync_tokens_per_s"] > 0
    t_plain = 1 / res["plain"]["tokens_per_s"]
    t_prop = res["spec"]["propose_ms_per_step"] / 1e3
    assert res["predicted_speedup_sync"] == pytest.approx(
        res["spec"]["tokens_per_step"] * t_plain / (1 / res["plain_sync_tokens_per_s"] + t_prop))
    # host phases per step: the core's and the model runner's, the proposer's only with drafts
    for phases in (res["plain"]["host_ms_per_step"], res["spec"]["host_ms_per_step"],
                   res["plain_sync_host_ms_per_step"]):
        assert {"core_schedule", "core_launch", "prepare", "forward_launch",
                "sample_launch"} <= set(phases)
        assert all(v >= 0 for v in phases.values())
    assert "propose" in res["spec"]["host_ms_per_step"]
    assert "propose" not in res["plain"]["host_ms_per_step"]
    assert res["spec"]["host_ms_per_step"]["propose"] == pytest.approx(
        res["spec"]["propose_ms_per_step"])
