"""The `peregrine` command line, run as a user would."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from peregrine.testing.checkpoints import tiny_checkpoint


@pytest.mark.slow
def test_generate_prints_completion_for_a_model_folder() -> None:
    path = str(tiny_checkpoint("llama"))
    proc = subprocess.run(
        [sys.executable, "-m", "peregrine.entrypoints.cli", "generate", "--model", path,
         "--device", "cpu", "--max-model-len", "64", "--max-tokens", "5", "hello world"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "Prompt: 'hello world'" in proc.stdout
    assert "[5 tokens, finish_reason=length]" in proc.stdout


def test_generate_reports_bad_model_folder_clearly(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "peregrine.entrypoints.cli", "generate", "--model",
         str(tmp_path / "missing"), "x"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2
    assert "is neither a local folder nor a Hugging Face model id" in proc.stderr


def test_every_engine_flag_has_help_text() -> None:
    import argparse
    import dataclasses

    from peregrine.config import ENGINE_ARGS_HELP, EngineArgs
    from peregrine.entrypoints.cli import add_engine_args
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    assert names == set(ENGINE_ARGS_HELP), "EngineArgs fields and their help text differ"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for action in parser._actions:
        if action.dest in names:
            assert action.help and action.help.strip(), action.dest


# Runs the CLI in a fresh interpreter (optionally with some modules made unimportable) and
# reports, after it exits, whether torch was imported.
_WRAPPER = """
import json, sys
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None  # as if not installed: importing it raises ModuleNotFoundError
from peregrine.entrypoints.cli import main
try:
    code = main(sys.argv[2:])
except SystemExit as e:
    code = e.code
print("TORCH_IMPORTED", "torch" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


def _cli(*argv: str, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    import json
    return subprocess.run([sys.executable, "-c", _WRAPPER, json.dumps(blocked), *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["bench", "--help"],
                                  ["bench", "throughput", "--help"], ["bench", "latency", "--help"],
                                  ["bench", "serve", "--help"]])
def test_help_answers_without_importing_torch(argv: list[str]) -> None:
    proc = _cli(*argv)
    assert proc.returncode == 0, proc.stderr
    assert "usage: peregrine" in proc.stdout
    assert "TORCH_IMPORTED False" in proc.stderr


def test_version_prints_the_package_version() -> None:
    import peregrine
    proc = subprocess.run([sys.executable, "-m", "peregrine", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"peregrine {peregrine.__version__}"


def test_python_dash_m_peregrine_runs_the_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "peregrine", "bench", "latency", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: peregrine bench latency")


def test_serve_without_the_serve_extra_names_the_install_command() -> None:
    proc = _cli("serve", "--port", "0", blocked=("fastapi",))
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("TORCH_IMPORTED")]
    assert lines == ['error: peregrine serve needs the serve extra (fastapi not installed): '
                     'pip install "peregrine-llm[serve]"'], proc.stderr
    assert "Traceback" not in proc.stderr


def test_readme_shows_the_serve_extra_install_command() -> None:
    from pathlib import Path

    from peregrine.entrypoints.cli import SERVE_EXTRA_INSTALL
    readme = Path(__file__).resolve().parent.parent / "README.md"
    assert SERVE_EXTRA_INSTALL in readme.read_text()


def _all_parsers():
    """Every parser of the command line: generate, serve, bench and its kinds."""
    import argparse

    from peregrine.entrypoints.cli import build_parser
    from peregrine.entrypoints.serve import add_serve_args
    found = {}

    def walk(name: str, p: argparse.ArgumentParser) -> None:
        found[name] = p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub_name, sub in a.choices.items():
                    walk(f"{name} {sub_name}", sub)

    walk("peregrine", build_parser())
    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    found["peregrine serve"] = serve
    return found


def test_every_flag_has_help_text_and_every_bench_flag_shows_its_default() -> None:
    import argparse
    for name, p in _all_parsers().items():
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._VersionAction,
                              argparse._SubParsersAction)) or not a.option_strings:
                continue
            assert a.help and a.help.strip(), f"{name} {a.option_strings[-1]} has no help"
            if name.startswith("peregrine bench ") and not a.required:
                assert "default" in a.help, f"{name} {a.option_strings[-1]} shows no default"
    # The default really is shown: %(default)s expands in the formatted help.
    text = _all_parsers()["peregrine bench serve"].format_help()
    assert "(default: 1000)" in text and "(default: http://127.0.0.1:8000)" in text


def test_every_boolean_flag_takes_the_no_form() -> None:
    import argparse
    for name, p in _all_parsers().items():
        for a in p._actions:
            if not a.option_strings or isinstance(a, (argparse._HelpAction,
                                                      argparse._VersionAction)):
                continue
            if a.nargs == 0:  # a switch: it must come as --flag / --no-flag
                assert isinstance(a, argparse.BooleanOptionalAction), (name, a.option_strings)
    bench = _all_parsers()["peregrine bench throughput"]
    ns = bench.parse_args(["--model", "m.json", "--no-enable-prefix-caching", "--enforce-eager"])
    assert (ns.enable_prefix_caching, ns.enforce_eager, ns.detokenize) == (False, True, True)
    assert bench.parse_args(["--model", "m.json", "--no-detokenize"]).detokenize is False


@pytest.mark.parametrize("command", ["peregrine generate", "peregrine serve",
                                     "peregrine bench throughput", "peregrine bench latency"])
def test_tp_and_pp_are_aliases_of_the_parallel_sizes(command: str) -> None:
    p = _all_parsers()[command]
    extra = ["--model", "m.json"] if command.startswith("peregrine bench") else []
    ns = p.parse_args([*extra, "-tp", "2", "-pp", "3"])
    assert (ns.tensor_parallel_size, ns.pipeline_parallel_size) == (2, 3)
    ns = p.parse_args([*extra, "--tensor-parallel-size", "4"])
    assert (ns.tensor_parallel_size, ns.pipeline_parallel_size) == (4, 1)


class _FakeLLM:
    """Stands in for LLM: the engine's answers without a model."""

    outcome: object = None

    def __init__(self, **kwargs) -> None:
        pass

    shutdowns = 0

    def shutdown(self) -> None:
        type(self).shutdowns += 1

    def generate(self, prompts, params, use_tqdm=True):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def _request_output(finish_reason: str, error: str | None = None):
    from peregrine.outputs import CompletionOutput, RequestOutput
    return RequestOutput(request_id="0", prompt="p", prompt_token_ids=[1],
                         outputs=[CompletionOutput(index=0, text="x", token_ids=[5],
                                                   finish_reason=finish_reason)],
                         finished=True, error=error)


@pytest.mark.parametrize("outcome,code,reason", [
    ([_request_output("length")], 0, None),
    ([_request_output("error", "step failed: boom")], 1, "step failed: boom"),
    (RuntimeError("engine core died"), 1, "engine core died"),
])
def test_generate_exits_non_zero_when_a_request_fails(monkeypatch, capsys, outcome, code,
                                                      reason) -> None:
    import peregrine.entrypoints.llm as llm_module
    from peregrine.entrypoints.cli import main
    fake = type("LLM", (_FakeLLM,), {"outcome": outcome})
    monkeypatch.setattr(llm_module, "LLM", fake)
    assert main(["generate", "p"]) == code
    assert fake.shutdowns == 1  # the engine is shut down, failed or not
    err = capsys.readouterr().err
    if reason is None:
        assert "error" not in err
    else:
        assert reason in err and err.startswith("error: ")


@pytest.mark.parametrize("model,message", [
    ("/no/such/config.json", "no such config file"),
    ("/no/such/folder", "neither a local folder nor a Hugging Face model id"),
])
def test_bench_reports_a_bad_model_path_in_one_line(capsys, model: str, message: str) -> None:
    from peregrine.entrypoints.cli import main
    assert main(["bench", "latency", "--model", model, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("error: ") and "\n" not in err


@pytest.mark.slow
def test_bench_latency_runs_on_the_cpu_and_removes_its_temporary_folder(tmp_path) -> None:
    import json
    import os
    import shutil
    config = tmp_path / "tiny.json"
    shutil.copy(Path(tiny_checkpoint("llama")) / "config.json", config)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "peregrine", "bench", "latency", "--model", str(config),
         "--device", "cpu", "--dtype", "float32", "--input-len", "8", "--output-len", "4",
         "--iters", "1", "--warmup", "0", "-tp", "1", "--output-json", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(scratch)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["workload"] == "W2" and result["decode_tokens_per_s"] > 0
    assert [p.name for p in scratch.iterdir() if p.name.startswith("peregrine-config-")] == []


def test_generate_sizes_the_engine_for_its_prompts() -> None:
    from peregrine.config import EngineArgs
    from peregrine.entrypoints.cli import PROMPT_TOKEN_MARGIN, fit_to_prompts
    args = EngineArgs(max_num_seqs=256, max_prefill_graph_tokens=2048)
    fit = fit_to_prompts(args, ["ab", "ü"], chat=False)
    assert (fit.max_num_seqs, fit.max_prefill_graph_tokens) == (2, 2 + 2 + 2 * PROMPT_TOKEN_MARGIN)
    assert fit.max_model_len == args.max_model_len and fit.model == args.model
    many = fit_to_prompts(args, ["x" * 100] * 300, chat=False)
    assert (many.max_num_seqs, many.max_prefill_graph_tokens) == (256, 2048)
    # a chat's template adds text the bound cannot know before the tokenizer loads
    assert fit_to_prompts(args, ["x"], chat=True).max_prefill_graph_tokens == 2048


def test_the_prompt_bound_covers_the_demo_tokenizers_count() -> None:
    from peregrine.demo import demo_model_path
    from peregrine.entrypoints.cli import PROMPT_TOKEN_MARGIN
    from peregrine.tokenizer import load_tokenizer
    tok = load_tokenizer(str(demo_model_path()))
    for text in ["", "def f(x):\n    return x", "naïve 東京 🦅🚀", "<|im_start|><pad>" * 3,
                 "\t\n  \r\n" * 20, "é" * 50]:
        assert len(tok.encode(text)) <= len(text.encode("utf-8")) + PROMPT_TOKEN_MARGIN


def test_the_generate_command_line_imports_no_bench_module() -> None:
    code = ("import sys; from peregrine.entrypoints.cli import build_parser; "
            "ns = build_parser('generate').parse_args(['generate', 'x']); "
            "print(ns.prompt, sorted(m for m in sys.modules if m.startswith('peregrine.bench')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert out.split() == ["['x']", "[]"]


@pytest.mark.parametrize("detok", [True, False])
def test_bench_throughput_with_and_without_detokenizing(detok: bool) -> None:
    from peregrine.bench.offline import build_parser, run_throughput
    from peregrine.testing.checkpoints import tiny_checkpoint
    ns = build_parser("throughput").parse_args(
        ["--model", str(tiny_checkpoint("llama")), "--device", "cpu", "--dtype", "float32",
         "--load-format", "auto", "--num-prompts", "3", "--min-input", "8", "--max-input", "12",
         "--min-output", "4", "--max-output", "6", "--detokenize" if detok else "--no-detokenize"])
    res = run_throughput(ns)
    assert res["detokenize"] is detok and 12 <= res["output_tokens"] <= 18
