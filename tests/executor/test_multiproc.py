"""MultiprocExecutor: worker processes behind the Executor interface; faults end in a clear error,
never a hang, and nothing is left behind."""
from __future__ import annotations

import gc
import os
import signal
import time

import pytest

from peregrine import LLM, SamplingParams
from peregrine.config import EngineArgs
from peregrine.executor import MultiprocExecutor, executor_class_for
from peregrine.executor.multiproc import WorkerFailedError
from peregrine.messages import CachedRequestData, NewRequestData, SchedulerOutput
from peregrine.testing.checkpoints import tiny_checkpoint

pytestmark = pytest.mark.slow  # each test starts worker processes (seconds each on two cores)


def _config(**kw):
    args = dict(model=str(tiny_checkpoint("llama")), dtype="float32", device="cpu",
                max_model_len=64, num_gpu_blocks_override=12, tensor_parallel_size=2)
    return EngineArgs(**{**args, **kw}).create_engine_config()


def _step(req_id: str, prompt: list[int]) -> SchedulerOutput:
    new = NewRequestData(req_id, prompt, SamplingParams(temperature=0.0), 0, (), [0], 0)
    return SchedulerOutput([new], CachedRequestData(), {req_id: len(prompt)}, len(prompt), [], [])


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _assert_cleaned_up(pids: list[int], ring: str) -> None:
    assert all(map(_gone, pids)), "a worker process outlived the executor"
    assert not os.path.exists(f"/dev/shm/{ring}"), "the shared-memory ring outlived the executor"


def test_a_killed_worker_fails_the_step_within_seconds_and_leaves_nothing() -> None:
    config = _config()
    ex = executor_class_for(config)(config)
    assert isinstance(ex, MultiprocExecutor) and ex.num_blocks == 12
    pids, ring = ex.worker_pids, ex.ring_name
    try:
        out = ex.execute_model(_step("a", [5, 6, 7])).result()
        assert out.req_ids == ["a"] and len(out.sampled_token_ids[0]) == 1
        ex.check_health()
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"rank 1 .*exited unexpectedly"):
            ex.execute_model(_step("b", [8, 9])).result()
        assert time.monotonic() - t0 < 5.0
        with pytest.raises(WorkerFailedError, match="rank 1"):
            ex.check_health()
        _assert_cleaned_up(pids, ring)
    finally:
        ex.shutdown()
    ex.shutdown()


def test_an_exception_in_a_step_fails_it_with_the_workers_message() -> None:
    config = _config()
    ex = executor_class_for(config)(config)
    pids, ring = ex.worker_pids, ex.ring_name
    try:
        bad = SchedulerOutput([], CachedRequestData(["nobody"], [[]], [0]), {"nobody": 1}, 1, [],
                              [])
        future = ex.execute_model(bad)  # asynchronous: the error comes with the result
        with pytest.raises(WorkerFailedError, match="'nobody' is unknown to the worker"):
            future.result()
        with pytest.raises(WorkerFailedError):
            ex.execute_model(_step("a", [5, 6]))
        _assert_cleaned_up(pids, ring)
    finally:
        ex.shutdown()


def test_the_engine_fails_its_requests_and_reports_unhealthy_when_a_worker_dies() -> None:
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=64,
              tensor_parallel_size=2)
    ex = llm.engine.core_client.core.executor
    pids, ring = ex.worker_pids, ex.ring_name
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 8
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    outs = llm.generate([[5, 6, 7], [9, 10]], params, use_tqdm=False)
    assert time.monotonic() - t0 < 10.0
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    with pytest.raises(WorkerFailedError, match="rank 0"):
        llm.engine.check_health()
    _assert_cleaned_up(pids, ring)
    llm.engine.shutdown()


def test_dropping_the_llm_stops_its_workers() -> None:
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=64,
              tensor_parallel_size=2)
    ex = llm.engine.core_client.core.executor
    pids, ring = ex.worker_pids, ex.ring_name
    del llm, ex
    gc.collect()
    _assert_cleaned_up(pids, ring)


_CTRL_C_SCRIPT = """
import faulthandler, signal, sys, time
from peregrine import LLM, SamplingParams
# NOTE: Ctrl-C as a terminal delivers it, whatever this test's own process inherited (a job
# started in the background without job control ignores SIGINT, and so would this driver).
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view of a hang
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_model_len=64, tensor_parallel_size=2)
    ex = llm.engine.core_client.core.executor
    print(" ".join(map(str, ex.worker_pids)), ex.ring_name, flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    while True:
        llm.generate([[5, 6, 7]] * 4, params, use_tqdm=False)
"""


def test_ctrl_c_in_the_driver_leaves_no_worker_and_no_segment(tmp_path) -> None:
    import subprocess
    import sys
    script = tmp_path / "drive.py"
    script.write_text(_CTRL_C_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_checkpoint("llama"))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().split()
        assert line, proc.stderr.read() if proc.wait(30) is not None else "no output"
        *pids, ring = line
        time.sleep(1.0)  # generating
        proc.send_signal(signal.SIGINT)
        # NOTE: the pipes are drained while waiting (the workers share them): a full pipe must
        # not be what stops the driver; a driver still running after 30 s shows its stacks.
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            proc.kill()
            _, err = proc.communicate()
            raise AssertionError(f"the driver did not exit on Ctrl-C; its stacks:\n{err[-6000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(int(p)) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    _assert_cleaned_up([int(p) for p in pids], ring)


def test_a_dead_worker_under_an_engine_core_process_makes_the_engine_unhealthy() -> None:
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=64,
              tensor_parallel_size=2, engine_core_process=True)
    try:
        core_pid = llm.engine.core_client._proc.pid  # noqa: SLF001
        with open(f"/proc/{core_pid}/task/{core_pid}/children") as f:
            workers = [int(p) for p in f.read().split()]
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        # NOTE: the failed request's output and the core's death race to the front end: either
        # the request finishes with an error or generate raises the core's error.
        try:
            out = llm.generate([[5, 6, 7]], params, use_tqdm=False)
            assert out[0].outputs[0].finish_reason == "error"
        except RuntimeError as e:
            assert "rank 1" in str(e)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                llm.engine.check_health()
            except RuntimeError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the engine still reports healthy with a dead worker")
        assert all(map(_gone, workers))
    finally:
        llm.engine.shutdown()
