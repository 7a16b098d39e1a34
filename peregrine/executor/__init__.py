"""Executors run the model on one or more workers; the engine sees only `Executor`."""
from __future__ import annotations

from peregrine.config import EngineConfig
from peregrine.executor.base import Executor, StepFuture

__all__ = ["Executor", "StepFuture", "executor_class_for"]


def executor_class_for(config: EngineConfig) -> type[Executor]:
    """The executor that runs `config`'s workers (one in-process worker for a single device)."""
    from peregrine.executor.uniproc import UniprocExecutor
    return UniprocExecutor
