"""Checkpoint loading: sharded files, dtypes, dummy weights, generation_config, and clear errors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from peregrine import LLM, SamplingParams
from peregrine.config import EngineArgs
from peregrine.testing.checkpoints import build_tiny_checkpoint, tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [[11, 42, 97, 130, 7, 300]]


def _copy(tmp_path: Path, arch: str = "llama") -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_checkpoint(arch), dst)
    return dst


def _tokens(path, **kw) -> list[int]:
    llm = LLM(str(path), device="cpu", max_model_len=64, **kw)
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_sharded_checkpoint_matches_single_file(tmp_path: Path) -> None:
    sharded = build_tiny_checkpoint(tmp_path / "sharded", "qwen2", num_shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert _tokens(sharded, dtype="float32") == _tokens(tiny_checkpoint("qwen2"), dtype="float32")


@pytest.mark.parametrize("dtype, want", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                         ("float16", torch.float16)])
def test_dtype_is_applied(dtype: str, want: torch.dtype) -> None:
    llm = LLM(tiny_checkpoint("llama"), device="cpu", max_model_len=64, dtype=dtype)
    model = llm.engine.core_client.core.executor.worker.model
    assert next(model.parameters()).dtype == want
    assert len(llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_dummy_weights_need_only_config(tmp_path: Path) -> None:
    d = tmp_path / "cfg-only"
    d.mkdir()
    shutil.copy(tiny_checkpoint("qwen3") / "config.json", d / "config.json")
    assert len(_tokens(d, load_format="dummy", skip_tokenizer_init=True)) == 8


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(d), device="cpu")


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_proj"):
        LLM(str(d), device="cpu")


def test_mismatched_tensor_is_named(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    tensors = load_file(d / "model.safetensors")
    w = tensors["model.layers.0.self_attn.o_proj.weight"]
    tensors["model.layers.0.self_attn.o_proj.weight"] = w[:, :-1].contiguous()
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight"):
        LLM(str(d), device="cpu")


def test_pickle_only_folder_is_refused(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        LLM(str(d), device="cpu")


def test_missing_config_field_is_named(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        EngineArgs(model=str(d)).create_engine_config()


def test_generation_config_defaults_apply(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update(temperature=0.25, top_p=0.5, top_k=7)
    (d / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(d), device="cpu", max_model_len=64)
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.25, 0.5, 7)


def test_unknown_engine_argument_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(tiny_checkpoint("llama"), device="cpu", max_num_seq=4)


def test_dummy_weights_fill_fp8_parameters() -> None:
    """FP8 checkpoints (fp8, compressed-tensors) have float8 weights; torch draws no normals in
    8 bits, so they are drawn in float32 and rounded."""
    from torch import nn

    from peregrine.worker.loader import init_dummy_weights

    m = nn.Module()
    m.weight = nn.Parameter(torch.zeros(64, 32, dtype=torch.float8_e4m3fn), requires_grad=False)
    init_dummy_weights(m, seed=0)
    w = m.weight.float()
    assert torch.isfinite(w).all() and 0.01 < w.std().item() < 0.04
