"""The ray backend's driver, with no Ray instance running on this host: it starts a local one
and stops it again at shutdown, leaving no Ray process behind.

NOTE: `ray.init(address="auto")` finds any Ray instance on this host (it looks for a running GCS
server), so this module must not share the host with another one (test_ray_executor.py's stops
at the end of its module)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from peregrine.testing.checkpoints import tiny_checkpoint

# NOTE: the ray tier (`pytest -m ray`, with the ray extra installed): a Ray instance and two actors
# start in a subprocess.
pytestmark = [pytest.mark.ray, pytest.mark.slow]

_OWNED_SCRIPT = """
import json, os, sys, time
from peregrine import LLM, SamplingParams

def descendants(pid):
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            kids = open(f"/proc/{pid}/task/{tid}/children").read().split()
        except OSError:
            kids = []
        for k in map(int, kids):
            out += [k] + descendants(k)
    return out

def alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False

if __name__ == "__main__":
    import ray
    llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_model_len=64,
              tensor_parallel_size=2, distributed_executor_backend="ray")
    started = ray.is_initialized()
    kids = {p: open(f"/proc/{p}/comm").read().strip() for p in descendants(os.getpid())}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    n = len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids)
    llm.engine.shutdown()
    deadline = time.monotonic() + 15
    while any(map(alive, kids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    print(json.dumps({"started": started, "tokens": n, "stopped": not ray.is_initialized(),
                      "processes": sorted(set(kids.values())),
                      "left": sorted({c for p, c in kids.items() if alive(p)})}), flush=True)
"""


def test_the_driver_stops_the_ray_instance_it_started(tmp_path) -> None:
    script = tmp_path / "drive.py"
    script.write_text(_OWNED_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), str(tiny_checkpoint("llama"))],
                          capture_output=True, text=True, env=env, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1])
    assert got["started"] and got["tokens"] == 4 and got["stopped"]
    assert {"gcs_server", "raylet"} <= set(got["processes"])  # it did start its own instance
    assert got["left"] == [], f"left running after shutdown: {got['left']}"


_CTRL_C_SCRIPT = """
import os, signal, sys
from peregrine import LLM, SamplingParams
# NOTE: Ctrl-C as a terminal delivers it, whatever this test's own process inherited.
signal.signal(signal.SIGINT, signal.default_int_handler)
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_model_len=64,
              tensor_parallel_size=2, distributed_executor_backend="ray")
    print(os.getpid(), flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    while True:
        llm.generate([[5, 6, 7]] * 4, params, use_tqdm=False)
"""


def _ray_processes(root: int) -> dict[int, str]:
    """root's descendant processes: pid -> name."""
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                kids = []
            for k in kids:
                try:
                    with open(f"/proc/{k}/comm") as f:
                        out[k] = f.read().strip()
                except OSError:
                    continue
                todo.append(k)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_ctrl_c_in_the_driver_leaves_no_ray_process(tmp_path) -> None:
    import signal
    import time
    script = tmp_path / "drive.py"
    script.write_text(_CTRL_C_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_checkpoint("llama"))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().strip()
        assert line, proc.stderr.read() if proc.wait(60) is not None else "no output"
        time.sleep(1.0)  # generating
        started = _ray_processes(proc.pid)
        assert {"gcs_server", "raylet"} <= set(started.values())
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 15
    while any(map(_alive, started)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = sorted({name for pid, name in started.items() if _alive(pid)})
    assert left == [], f"left running after Ctrl-C: {left}"
