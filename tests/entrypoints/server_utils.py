"""Run the real app under uvicorn on 127.0.0.1 (OS-picked port) in a background thread, or a
fake-engine server in a process of its own."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from peregrine.engine.async_engine import AsyncEngine
from peregrine.entrypoints.openai.api_server import (ServerArgs, bind_socket, build_app,
                                                     make_uvicorn_server)


TINY_MODEL_NAME = "tiny-llama"  # served name of the session's real server (conftest.py)


class RunningServer:
    """`with RunningServer(engine) as s:` -> s.base_url ("http://127.0.0.1:PORT")."""

    def __init__(self, engine: Any, **server_args: Any) -> None:
        server_args.setdefault("log_stats_interval", 0.0)
        self.args = ServerArgs(host="127.0.0.1", port=0, **server_args)
        self.async_engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
        self.app = build_app(self.async_engine, self.args)
        self._sock = bind_socket("127.0.0.1", 0)
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._server = make_uvicorn_server(self.app, self.args)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        daemon=True)

    def start(self) -> RunningServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        self._sock.close()

    def __enter__(self) -> RunningServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# A fake-engine server in its own process through run_server (the path `peregrine serve` takes),
# started with a given soft open-file limit; prints its port, then serves until terminated.
_FAKE_SERVER = """
import resource, sys
sys.path.insert(0, {here!r})
soft = {soft!r}
if soft is not None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from fake_engine import FakeEngine
from peregrine.engine.async_engine import AsyncEngine
from peregrine.entrypoints.openai.api_server import ServerArgs, bind_socket, run_server
sock = bind_socket("127.0.0.1", 0)
print(sock.getsockname()[1], flush=True)
run_server(AsyncEngine(FakeEngine(**{engine!r})), ServerArgs(port=0, log_stats_interval=0.0,
           shutdown_timeout=1.0), sock)
"""


class FakeServerProcess:
    """`with FakeServerProcess(soft_nofile=1024) as s:` -> s.base_url, s.proc (the server)."""

    def __init__(self, *, soft_nofile: int | None = None, **engine_kwargs: Any) -> None:
        code = _FAKE_SERVER.format(here=str(Path(__file__).parent), soft=soft_nofile,
                                   engine=engine_kwargs)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"the fake server did not start: {self.proc.stderr.read()[-2000:]}")
        self.port = int(line)
        self.base_url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("the fake server never became healthy")
            time.sleep(0.05)

    def stop(self) -> str:
        """Terminate the server; its stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.stderr.read()

    def __enter__(self) -> FakeServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
