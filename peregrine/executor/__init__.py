"""Executors run the model on one or more workers; the engine sees only `Executor`."""
from __future__ import annotations

from peregrine.config import EngineConfig
from peregrine.executor.base import Executor, StepFuture

__all__ = ["Executor", "MultiprocExecutor", "StepFuture", "UniprocExecutor", "executor_class_for"]


def __getattr__(name: str):
    # NOTE: imported on first use: the workers pull in torch and the model code.
    if name == "UniprocExecutor":
        from peregrine.executor.uniproc import UniprocExecutor
        return UniprocExecutor
    if name == "MultiprocExecutor":
        from peregrine.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def executor_class_for(config: EngineConfig) -> type[Executor]:
    """The executor that runs `config`'s workers: `distributed_executor_backend` uni (one
    in-process worker) or mp (one process per rank)."""
    if config.distributed_executor_backend == "mp":
        from peregrine.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor
    from peregrine.executor.uniproc import UniprocExecutor
    return UniprocExecutor
