"""Executors run the model on one or more workers; the engine sees only `Executor`."""
from __future__ import annotations

from peregrine.config import EngineConfig
from peregrine.executor.base import Executor, StepFuture

__all__ = ["Executor", "StepFuture", "UniprocExecutor", "executor_class_for"]


def __getattr__(name: str):
    # NOTE: imported on first use: the workers pull in torch and the model code.
    if name == "UniprocExecutor":
        from peregrine.executor.uniproc import UniprocExecutor
        return UniprocExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def executor_class_for(config: EngineConfig) -> type[Executor]:
    """The executor that runs `config`'s workers (one in-process worker for a single device)."""
    from peregrine.executor.uniproc import UniprocExecutor
    return UniprocExecutor
