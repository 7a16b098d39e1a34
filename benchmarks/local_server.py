"""A server subprocess on a free local port for the benchmarks that load one (soak.py,
pool_cost.py): started, waited for until /health answers, stopped."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], log_path: str, timeout: float,
                 stop_signal: int = signal.SIGTERM) -> tuple[subprocess.Popen, str]:
    """Run `cmd` (a serve command line without host and port) on a free local port, its output
    in log_path; (process, base url) once /health answers 200."""
    port = free_port()
    cmd = [*cmd, "--host", "127.0.0.1", "--port", str(port), "--log-stats-interval", "0"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(proc, stop_signal)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f}s; see {log_path}")


def stop_server(proc: subprocess.Popen, stop_signal: int = signal.SIGTERM) -> None:
    """Signal the server, wait up to a minute, then kill it."""
    if proc.poll() is None:
        proc.send_signal(stop_signal)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
