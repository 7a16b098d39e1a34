"""The `peregrine` command line, run as a user would."""
from __future__ import annotations

import subprocess
import sys

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
