"""The server with --speculative-config: the flag parses, completions are the plain engine's, and
/metrics carries the acceptance counters."""
from __future__ import annotations

import argparse
import json

import httpx

from peregrine.engine.llm_engine import LLMEngine
from peregrine.entrypoints.cli import engine_args_from
from peregrine.entrypoints.serve import add_serve_args
from peregrine.testing.checkpoints import tiny_checkpoint
from tests.entrypoints.server_utils import RunningServer

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
PROMPT = [(10 + 7 * i) % 500 + 5 for i in range(6)] * 3


def _engine(spec: dict | None) -> LLMEngine:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    argv = [str(tiny_checkpoint("llama")), "--device", "cpu", "--dtype", "float32",
            "--max-model-len", "128"]
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    return LLMEngine.from_engine_args(engine_args_from(parser.parse_args(argv)))


def _complete(base_url: str) -> str:
    body = {"model": str(tiny_checkpoint("llama")), "prompt": PROMPT, "max_tokens": 20,
            "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_server_serves_with_speculative_config() -> None:
    with RunningServer(_engine(None)) as plain:
        want = _complete(plain.base_url)
    with RunningServer(_engine(SPEC)) as s:
        assert want and _complete(s.base_url) == want
        metrics = httpx.get(f"{s.base_url}/metrics", timeout=30).text
    accepted = [line for line in metrics.splitlines()
                if line.startswith("peregrine_spec_decode_num_accepted_tokens_total{")]
    assert accepted and float(accepted[0].rsplit(" ", 1)[1]) > 0
