"""UniprocExecutor: one Worker in this process, on the configured device."""
from __future__ import annotations

from peregrine.config import EngineConfig
from peregrine.executor.base import Executor
from peregrine.messages import ModelRunnerOutput, SchedulerOutput
from peregrine.worker.model_runner import StepHandle
from peregrine.worker.worker import Worker


class UniprocStepFuture:
    """A step launched on the in-process worker; `result()` collects it once."""

    def __init__(self, worker: Worker, handle: StepHandle) -> None:
        self._worker = worker
        self._handle: StepHandle | None = handle
        self._result: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._result = self._worker.collect(handle)
        return self._result


class UniprocExecutor(Executor):
    """Builds one Worker, sizes the KV cache from it, and runs every step on it."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if config.world_size != 1:
            raise ValueError(f"UniprocExecutor runs one worker, not {config.world_size} "
                             f"(tensor_parallel_size x pipeline_parallel_size)")
        self.worker: Worker | None = Worker(config, rank=0, local_rank=0)
        # NOTE: the minimum over workers; one here.
        self.num_blocks = min([self.worker.determine_num_blocks()])
        self.worker.initialize_cache(self.num_blocks)
        self.weight_bytes = sum(p.numel() * p.element_size()
                                for p in self.worker.model.parameters())

    def execute_model(self, scheduler_output: SchedulerOutput) -> UniprocStepFuture:
        """Launch the step on the worker; the future's result() waits for it."""
        worker = self._live_worker()
        return UniprocStepFuture(worker, worker.execute_model(scheduler_output))

    def check_health(self) -> None:
        self._live_worker().check_health()

    def shutdown(self) -> None:
        self.worker = None

    def _live_worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("the executor is shut down")
        return self.worker
