"""Executors run the model on one or more workers; the engine sees only `Executor`."""
from peregrine.executor.base import Executor, StepFuture

__all__ = ["Executor", "StepFuture"]
