"""Shared fixtures: one real server (tiny llama, CPU) for the whole session; helpers importable."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))



@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from peregrine.testing.checkpoints import tiny_checkpoint
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="session")
def real_server(tiny_model_path):
    """The real LLMEngine behind the real app under uvicorn on 127.0.0.1."""
    from peregrine.config import EngineArgs
    from peregrine.engine.async_engine import AsyncEngine
    from server_utils import TINY_MODEL_NAME, RunningServer

    args = EngineArgs(model=tiny_model_path, device="cpu", served_model_name=TINY_MODEL_NAME,
                      max_model_len=256, num_gpu_blocks_override=512, block_size=16)
    with RunningServer(AsyncEngine.from_engine_args(args)) as server:
        yield server
