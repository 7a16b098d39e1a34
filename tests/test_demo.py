"""Tests for the built-in demo model (peregrine.demo)."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch

from peregrine import demo


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("peregrine-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PEREGRINE_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def demo_path(cache_root: Path) -> Path:
    return demo.demo_model_path()


def test_demo_model_builds_into_cache_dir(cache_root: Path, demo_path: Path) -> None:
    assert demo_path == cache_root / demo.DEMO_MODEL_NAME
    names = {p.name for p in demo_path.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "model.safetensors"} <= names
    # Nothing left over from the temp-dir build.
    assert [p.name for p in cache_root.iterdir()] == [demo.DEMO_MODEL_NAME]


def test_demo_config_is_small_llama(demo_path: Path) -> None:
    cfg = json.loads((demo_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"]) == (256, 4, 8, 4)
    assert cfg["vocab_size"] == 2048 and cfg["max_position_embeddings"] == 2048
    assert cfg["torch_dtype"] == "bfloat16"


def test_demo_tokenizer_has_chat_template(demo_path: Path) -> None:
    from transformers import AutoTokenizer
    assert "chat_template" in json.loads((demo_path / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(demo_path)
    assert len(tok) == 2048
    text = tok.apply_chat_template([{"role": "user", "content": "Hello?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHello?<|im_end|>\n<|im_start|>assistant\n")


def test_second_call_reuses_cache(demo_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  caplog: pytest.LogCaptureFixture) -> None:
    def fail(out_dir):
        raise AssertionError("rebuilt a cached demo model")
    monkeypatch.setattr(demo, "build_demo_model", fail)
    with caplog.at_level(logging.INFO, logger="peregrine.demo"):
        assert demo.demo_model_path() == demo_path
    assert not caplog.records


def test_build_logs_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PEREGRINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(demo, "build_demo_model", _fake_build)
    with caplog.at_level(logging.INFO, logger="peregrine.demo"):
        demo.demo_model_path()
    assert len(caplog.records) == 1 and "building" in caplog.records[0].getMessage()


def _fake_build(out_dir: Path) -> Path:
    # Cheap stand-in for build_demo_model: a complete-looking folder.
    (Path(out_dir) / "config.json").write_text("{}")
    (Path(out_dir) / demo._DEMO_MARKER).write_text(demo.DEMO_MODEL_NAME + "\n")
    return Path(out_dir)


def test_demo_rebuild_is_deterministic(demo_path: Path, tmp_path: Path) -> None:
    again = demo.build_demo_model(tmp_path / "again")
    assert _hashes(again) == _hashes(demo_path)


def test_concurrent_first_use_keeps_winner(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulate another process finishing first: it lands the final folder while we build.
    monkeypatch.setenv("PEREGRINE_CACHE_DIR", str(tmp_path))
    final = tmp_path / demo.DEMO_MODEL_NAME

    def racing_build(out_dir: Path) -> Path:
        final.mkdir()
        _fake_build(final)
        (final / "winner").write_text("1")
        return _fake_build(out_dir)
    monkeypatch.setattr(demo, "build_demo_model", racing_build)
    assert demo.demo_model_path() == final
    assert (final / "winner").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [demo.DEMO_MODEL_NAME]


def test_incomplete_folder_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEREGRINE_CACHE_DIR", str(tmp_path))
    final = tmp_path / demo.DEMO_MODEL_NAME
    final.mkdir()
    (final / "junk").write_text("half-copied")
    monkeypatch.setattr(demo, "build_demo_model", _fake_build)
    assert demo.demo_model_path() == final
    assert not (final / "junk").exists() and (final / demo._DEMO_MARKER).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [demo.DEMO_MODEL_NAME]


def test_failed_build_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEREGRINE_CACHE_DIR", str(tmp_path))

    def broken(out_dir: Path) -> Path:
        raise RuntimeError("disk full")
    monkeypatch.setattr(demo, "build_demo_model", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        demo.demo_model_path()
    assert list(tmp_path.iterdir()) == []


def test_demo_generates_varied_greedy_text(demo_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(demo_path).eval()
    tok = AutoTokenizer.from_pretrained(demo_path)
    assert model.dtype == torch.bfloat16
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    assert len(set(out[0, ids.shape[1]:].tolist())) >= 8


def test_engine_config_defaults_to_demo(demo_path: Path) -> None:
    from peregrine.config import EngineArgs
    cfg = EngineArgs().create_engine_config().model
    assert Path(cfg.model) == demo_path
    assert cfg.architecture == "LlamaForCausalLM" and cfg.dtype == torch.bfloat16
    assert (cfg.max_model_len, cfg.vocab_size, cfg.head_dim) == (2048, 2048, 32)
    assert cfg.eos_token_ids == (1, 3)
