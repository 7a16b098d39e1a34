"""Environment variables are read in peregrine/envs.py, with their defaults."""
from __future__ import annotations

import pytest

from peregrine import envs


def test_defaults(monkeypatch) -> None:
    for name in ("PEREGRINE_ATTENTION_BACKEND", "PEREGRINE_FUSED_KERNELS", "PEREGRINE_DEBUG_CHECKS",
                 "PEREGRINE_CACHE_DIR", "PEREGRINE_API_KEY", "TRITON_INTERPRET",
                 "PEREGRINE_CORE_PACING", "PEREGRINE_PP_LAYER_PARTITION",
                 "PEREGRINE_DEPENDENT_LAUNCH", "PEREGRINE_GRAPH_PATHS_ON_CPU",
                 "PEREGRINE_WNA16_GEMV", "PEREGRINE_DECODE_LAYERS"):
        monkeypatch.delenv(name, raising=False)
    assert envs.attention_backend() is None and envs.cache_dir() is None
    assert envs.api_key() is None
    assert envs.fused_kernels() and not envs.debug_checks() and not envs.triton_interpret()
    assert envs.core_pacing()
    assert envs.pp_layer_partition() is None
    assert envs.dependent_launch() and not envs.graph_paths_on_cpu()
    assert envs.wna16_gemv_variant() is None
    assert not envs.decode_layers()


def test_values_are_read_when_called(monkeypatch) -> None:
    monkeypatch.setenv("PEREGRINE_ATTENTION_BACKEND", "torch")
    monkeypatch.setenv("PEREGRINE_FUSED_KERNELS", "0")
    monkeypatch.setenv("PEREGRINE_DEBUG_CHECKS", "1")
    monkeypatch.setenv("PEREGRINE_API_KEY", "secret")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PEREGRINE_CORE_PACING", "0")
    monkeypatch.setenv("PEREGRINE_PP_LAYER_PARTITION", "5,4")
    monkeypatch.setenv("PEREGRINE_DEPENDENT_LAUNCH", "0")
    monkeypatch.setenv("PEREGRINE_GRAPH_PATHS_ON_CPU", "1")
    monkeypatch.setenv("PEREGRINE_WNA16_GEMV", "half2_async")
    monkeypatch.setenv("PEREGRINE_DECODE_LAYERS", "1")
    assert envs.decode_layers() == "split"
    assert not envs.dependent_launch() and envs.graph_paths_on_cpu()
    assert envs.wna16_gemv_variant() == "half2_async"
    assert envs.attention_backend() == "torch" and envs.api_key() == "secret"
    assert not envs.fused_kernels() and envs.debug_checks() and envs.triton_interpret()
    assert not envs.core_pacing()
    assert envs.pp_layer_partition() == "5,4"


def test_the_one_kernel_decode_forms(monkeypatch) -> None:
    for value, form in (("0", None), ("off", None), ("true", "split"), ("split", "split"),
                        ("Rows", "rows")):
        monkeypatch.setenv("PEREGRINE_DECODE_LAYERS", value)
        assert envs.decode_layers() == form, value
    monkeypatch.setenv("PEREGRINE_DECODE_LAYERS", "tiles")
    with pytest.raises(ValueError, match="split or rows"):
        envs.decode_layers()
