"""Executors run the model on one or more workers; the engine sees only `Executor`."""
from __future__ import annotations

import importlib

from peregrine.config import EngineConfig
from peregrine.executor.base import Executor, StepFuture, WorkerFailedError

__all__ = ["EXECUTOR_BACKENDS", "Executor", "MultiprocExecutor", "StepFuture", "UniprocExecutor",
           "WorkerFailedError", "executor_class_for"]

# distributed_executor_backend -> (module, class). NOTE: imported on first use: the workers pull
# in torch and the model code, and an optional backend's package may not be installed.
EXECUTOR_BACKENDS: dict[str, tuple[str, str]] = {
    "uni": ("peregrine.executor.uniproc", "UniprocExecutor"),  # one in-process worker
    "mp": ("peregrine.executor.multiproc", "MultiprocExecutor"),  # one process per rank
    "ray": ("peregrine.executor.ray_executor", "RayExecutor"),  # one Ray actor per rank
}


def __getattr__(name: str):
    for module, cls in EXECUTOR_BACKENDS.values():
        if cls == name:
            return getattr(importlib.import_module(module), cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def executor_class_for(config: EngineConfig) -> type[Executor]:
    """The executor that runs `config`'s workers, by `distributed_executor_backend`."""
    try:
        module, cls = EXECUTOR_BACKENDS[config.distributed_executor_backend]
    except KeyError:
        raise ValueError(f"unknown distributed_executor_backend "
                         f"{config.distributed_executor_backend!r} (expected one of "
                         f"{', '.join(EXECUTOR_BACKENDS)})") from None
    return getattr(importlib.import_module(module), cls)
