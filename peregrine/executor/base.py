"""The engine's view of the workers: send a SchedulerOutput, get a ModelRunnerOutput back."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from peregrine.config import EngineConfig
from peregrine.messages import ModelRunnerOutput, SchedulerOutput


class WorkerFailedError(RuntimeError):
    """A worker died or its step raised; the executor cannot serve any more."""


class StepFuture(Protocol):
    """A launched step; `result()` waits for it (the step's one device->host sync)."""

    def result(self) -> ModelRunnerOutput: ...


class NumberedStepFuture:
    """A step an executor sent to its workers under a sequence number; `result()` asks the
    executor for that step's output (from the output rank) once and keeps it."""

    def __init__(self, executor: Any, seq: int) -> None:
        self._executor = executor  # has _result_of(seq) -> ModelRunnerOutput
        self._seq = seq
        self._out: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._out is None:
            self._out = self._executor._result_of(self._seq)  # noqa: SLF001
        return self._out


class Executor(ABC):
    """Owns tensor_parallel_size x pipeline_parallel_size workers (uniproc.py: one in this
    process; multiproc.py: one process per rank; ray_executor.py: one Ray actor per rank).

    After construction every worker has loaded its shard of the model, the KV cache is allocated
    with `num_blocks` blocks (the minimum any worker can hold) and CUDA graphs are captured.
    """

    num_blocks: int
    weight_bytes: int  # the model's weights summed over every worker's shard

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Queue one step on every worker; return without waiting for the device."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise if a worker can no longer serve (kept cheap: /health calls it)."""

    def stage_stats(self, reset: bool = False) -> list[dict[str, float]]:
        """Pipeline parallelism: each rank's stage timers (steps, busy_s, span_s,
        idle_fraction, recv_wait_s) since the last reset; [] without pipeline stages."""
        return []

    def shutdown(self) -> None:
        """Release the workers (processes, device memory); safe to call twice."""
