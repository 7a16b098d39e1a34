"""Quantization configs keep their method name in a process that only unpickled them (the engine
core process and parallel workers receive the engine config that way)."""
from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from peregrine.layers.quantization import get_quantization_config, quantization_methods


def test_every_builtin_config_declares_its_own_name() -> None:
    for name in quantization_methods():
        assert get_quantization_config(name).name == name


def test_names_survive_unpickling_in_a_fresh_process() -> None:
    # NOTE: the built-in methods; a plug-in's class gets its name from the decorator, which runs
    # when the unpickling process imports the plug-in's module (test plug-ins are not importable
    # from a fresh interpreter).
    classes = {name: cls for name in quantization_methods()
               if (cls := get_quantization_config(name)).__module__.startswith("peregrine.")}
    assert "fp8" in classes and "awq" in classes
    script = ("import pickle, sys\n"
              "classes = pickle.loads(sys.stdin.buffer.read())\n"
              "print(sorted((n, getattr(c, 'name', None)) for n, c in classes.items()))\n")
    out = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(classes),
                         capture_output=True, check=True, timeout=120).stdout.decode()
    assert out.strip() == str(sorted((n, n) for n in classes))


def test_online_fp8_config_pickles_with_its_name() -> None:
    cfg = get_quantization_config("fp8").from_config({})
    script = ("import pickle, sys\n"
              "print(pickle.loads(sys.stdin.buffer.read()).name)\n")
    out = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(cfg),
                         capture_output=True, check=True, timeout=120).stdout.decode()
    assert out.strip() == "fp8"


def test_unknown_method_is_named() -> None:
    with pytest.raises(ValueError, match="'nope'"):
        get_quantization_config("nope")
