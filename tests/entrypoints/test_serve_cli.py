"""`peregrine serve` flags (generated from the dataclasses) and one real run as a subprocess."""
from __future__ import annotations

import argparse
import ast
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from peregrine.config import EngineArgs
from peregrine.entrypoints.cli import engine_args_from
from peregrine.entrypoints.openai.api_server import ServerArgs
from peregrine.entrypoints.serve import add_serve_args, serve_main, server_args_from

REPO = Path(__file__).resolve().parents[2]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(argv)


def test_defaults_come_from_the_dataclasses():
    ns = _parse([])
    assert engine_args_from(ns) == EngineArgs()
    assert server_args_from(ns) == ServerArgs()


def test_engine_and_server_flags_parse_into_their_dataclasses():
    ns = _parse(["/models/x", "--host", "0.0.0.0", "--port", "9000", "--api-key", "k",
                 "--served-model-name", "m", "--max-model-len", "512", "--max-num-seqs", "8",
                 "--max-num-batched-tokens", "1024", "--gpu-memory-utilization", "0.5",
                 "--block-size", "32", "--dtype", "bfloat16", "--no-enable-prefix-caching",
                 "--scheduling-policy", "priority", "--max-queue-len", "10", "--enforce-eager",
                 "--load-format", "dummy", "--max-request-body-bytes", "100",
                 "--health-no-progress-timeout", "5"])
    e, s = engine_args_from(ns), server_args_from(ns)
    assert (e.model, e.served_model_name, e.max_model_len, e.max_num_seqs) == ("/models/x", "m", 512, 8)
    assert (e.max_num_batched_tokens, e.gpu_memory_utilization, e.block_size) == (1024, 0.5, 32)
    assert (e.dtype, e.enable_prefix_caching, e.scheduling_policy) == ("bfloat16", False, "priority")
    assert (e.max_queue_len, e.enforce_eager, e.load_format) == (10, True, "dummy")
    assert (s.host, s.port, s.api_key, s.max_request_body_bytes) == ("0.0.0.0", 9000, "k", 100)
    assert s.health_no_progress_timeout == 5.0


def test_security_flags_parse_into_server_args():
    assert (ServerArgs().trust_request_chat_template, ServerArgs().max_prompt_chars) == (False, None)
    s = server_args_from(_parse(["--trust-request-chat-template", "--max-prompt-chars", "1000"]))
    assert (s.trust_request_chat_template, s.max_prompt_chars) == (True, 1000)
    with pytest.raises(ValueError, match="max_prompt_chars"):
        server_args_from(_parse(["--max-prompt-chars", "0"]))


def test_help_documents_the_security_flags(capsys):
    with pytest.raises(SystemExit):
        serve_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--trust-request-chat-template" in out and "without a time bound" in out
    assert "--max-prompt-chars" in out and "16 per token of max_model_len" in out
    assert "/tokenize, /detokenize and /tokenizer_info" in out


def test_help_documents_the_host_default_and_the_openai_limits_flag(capsys):
    with pytest.raises(SystemExit):
        serve_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    host_help = out[out.rindex("--host HOST"):out.rindex("--port PORT")]  # the help, not usage
    assert "this machine only" in host_help and "0.0.0.0" in host_help
    assert "(default: 127.0.0.1)" in host_help
    assert "--relax-openai-limits" in out and "temperature up to 100 instead of 2" in out


def test_relax_openai_limits_flag_parses_into_server_args():
    assert ServerArgs().relax_openai_limits is False
    assert server_args_from(_parse(["--relax-openai-limits"])).relax_openai_limits is True


@pytest.fixture()
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_busy_port_is_one_line_and_a_nonzero_exit_before_the_model_loads(busy_port, capsys,
                                                                         monkeypatch):
    from peregrine.engine.async_engine import AsyncEngine
    loads = []
    monkeypatch.setattr(AsyncEngine, "from_engine_args",
                        classmethod(lambda cls, args: loads.append(args)))
    code = serve_main(["--host", "127.0.0.1", "--port", str(busy_port), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code != 0 and loads == []
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert f"127.0.0.1:{busy_port}" in err and "already in use" in err and "--port" in err


def test_listen_or_explain_holds_the_port(busy_port):
    from peregrine.entrypoints.openai.api_server import listen_or_explain
    sock = listen_or_explain("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        # NOTE: the port is ours from now on: nobody else can bind it, SO_REUSEADDR or not.
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}: it is already"):
            listen_or_explain("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # it accepts connections into its backlog before the server runs
    finally:
        sock.close()
    with pytest.raises(ValueError, match="already in use"):
        listen_or_explain("127.0.0.1", busy_port)


def test_serving_code_imports_no_benchmark_code():
    # NOTE: cli.py may: it dispatches `peregrine bench ...` to the benchmarks.
    package = REPO / "peregrine"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if package / "bench" in path.parents or path == package / "entrypoints" / "cli.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        if any(m == "peregrine.bench" or m.startswith("peregrine.bench.") for m in names):
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []
    code = ("import sys, peregrine.entrypoints.serve; "
            "print([m for m in sys.modules if m.startswith('peregrine.bench')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         check=True).stdout
    assert out.strip() == "[]"


def test_no_model_means_the_demo_model():
    assert engine_args_from(_parse([])).model is None


def test_api_key_falls_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("PEREGRINE_API_KEY", "from-env")
    assert server_args_from(_parse([])).api_key == "from-env"


def test_bad_model_folder_exits_with_code_2(tmp_path, capsys):
    assert serve_main([str(tmp_path / "missing"), "--device", "cpu", "--port", "0"]) == 2
    assert "error:" in capsys.readouterr().err


def test_model_flag_is_the_positional_model(tmp_path, capsys):
    code = serve_main(["--model", str(tmp_path / "missing"), "--port", "0"])
    assert code == 2 and "missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_main([str(tmp_path / "a"), "--model", str(tmp_path / "b")])
    assert "two models given" in capsys.readouterr().err


@pytest.mark.slow
def test_peregrine_serve_runs_and_answers(tiny_model_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-c", "import sys; from peregrine.entrypoints.cli import main; "
           "sys.exit(main(sys.argv[1:]))", "serve", tiny_model_path, "--port", "0",
           "--device", "cpu", "--num-gpu-blocks-override", "64", "--max-model-len", "128",
           "--served-model-name", "cli-model", "--log-stats-interval", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env, cwd=REPO)
    try:
        port = None
        deadline = time.monotonic() + 90
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            m = re.search(r"on http://[\d.]+:(\d+)", line)
            if m:
                port = int(m.group(1))
        assert port is not None, "server did not report its port"
        base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == "cli-model"
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("server did not stop on SIGINT")


def test_config_json_means_dummy_weights_without_tokenizer(tiny_model_path):
    from peregrine.entrypoints.serve import resolve_model_arg
    cfg = str(Path(tiny_model_path) / "config.json")
    args = resolve_model_arg(EngineArgs(model=cfg))
    assert Path(args.model, "config.json").is_file() and args.model != cfg
    assert (args.load_format, args.skip_tokenizer_init, args.served_model_name) == ("dummy", True, cfg)
    folder = EngineArgs(model=tiny_model_path)
    assert resolve_model_arg(folder) == folder
