"""The engine's one start-up line: every phase of an in-process start, adding up to the total."""
from __future__ import annotations

import logging

import pytest

from peregrine.config import EngineArgs
from peregrine.engine.llm_engine import LLMEngine
from peregrine.startup_timing import LINE_PREFIX, OVERLAPPED, STARTUP, parse_line
from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.worker.worker import Worker


def _args(**kw) -> EngineArgs:
    return EngineArgs(model=str(tiny_checkpoint("llama")), dtype="float32", device="cpu",
                      max_model_len=64, max_num_seqs=2, **kw)


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if LINE_PREFIX in r.getMessage()]


def test_an_engine_logs_one_line_with_its_workers_phases_nested(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="peregrine"):
        engine = LLMEngine.from_engine_args(_args())
    lines = _lines(caplog)
    assert len(lines) == 1
    s = engine.startup_seconds
    assert parse_line(lines[0]) == pytest.approx(s, abs=0.006)  # two decimals in the line
    for key in ("import_torch", "config", "tokenizer_overlapped", "engine_core",
                "engine_core/device",
                "engine_core/model", "engine_core/runner", "engine_core/kv_alloc",
                "engine_core/other", "other", "total"):
        assert key in s, key
    # NOTE: the tokenizer loads in a thread beside engine_core: outside the sum.
    top = [v for k, v in s.items() if "/" not in k and k != "total" and not k.endswith(OVERLAPPED)]
    assert sum(top) == pytest.approx(s["total"], rel=1e-6)
    nested = [v for k, v in s.items() if k.startswith("engine_core/")]
    assert sum(nested) == pytest.approx(s["engine_core"], rel=1e-6)
    assert not STARTUP.active


def test_a_second_engine_starts_its_phases_afresh(caplog) -> None:
    LLMEngine.from_engine_args(_args())
    with caplog.at_level(logging.INFO, logger="peregrine"):
        s = LLMEngine(_args(skip_tokenizer_init=True).create_engine_config()).startup_seconds
    assert "pre_engine" not in s and "config" not in s  # built from a config: no config phase
    assert s["engine_core/model"] > 0 and len(_lines(caplog)) == 1


def test_a_worker_with_no_engine_in_its_process_logs_its_own_line(caplog) -> None:
    config = _args(num_gpu_blocks_override=8).create_engine_config()
    with caplog.at_level(logging.INFO, logger="peregrine"):
        worker = Worker(config)
        worker.initialize_cache(worker.determine_num_blocks())
    lines = _lines(caplog)
    assert len(lines) == 1 and "[worker rank 0, pid" in lines[0]
    phases = parse_line(lines[0])
    assert {"device", "model", "runner", "kv_alloc"} <= set(phases)
