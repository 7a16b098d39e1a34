"""Run the real app under uvicorn on 127.0.0.1 (OS-picked port) in a background thread."""
from __future__ import annotations

import threading
import time
from typing import Any

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
