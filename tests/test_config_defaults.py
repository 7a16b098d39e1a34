"""CPU defaults and refusals at config time: the attention backend, GPU-only knobs, the KV cache's
size and memory, missing model and tokenizer files."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peregrine.config import EngineArgs
from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.worker.kv_memory import GiB, allocate_kv_caches, cpu_num_blocks


def _config(**kw):
    return EngineArgs(model=str(tiny_checkpoint("llama")), device="cpu", **kw).create_engine_config()


def test_triton_backend_on_the_cpu_without_the_interpreter_is_refused(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend.*needs CUDA") as info:
        _config(attention_backend="triton")
    msg = str(info.value)
    assert "torch backend" in msg and "TRITON_INTERPRET=1" in msg
    monkeypatch.setenv("PEREGRINE_ATTENTION_BACKEND", "triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        _config()


def test_triton_backend_on_the_cpu_under_the_interpreter_is_accepted(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _config(attention_backend="triton").attention_backend == "triton"


def test_the_cpu_defaults_to_the_torch_backend(monkeypatch) -> None:
    monkeypatch.delenv("PEREGRINE_ATTENTION_BACKEND", raising=False)
    assert _config().attention_backend == "torch"


def test_gpu_memory_utilization_given_on_the_cpu_is_refused() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization.*cpu_kv_cache_gb"):
        _config(gpu_memory_utilization=0.5)


def test_gpu_memory_utilization_defaults_to_090_when_not_given() -> None:
    assert EngineArgs().gpu_memory_utilization is None
    assert _config().cache.gpu_memory_utilization == 0.9


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_a_non_positive_cpu_kv_cache_size_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="cpu_kv_cache_gb"):
        _config(cpu_kv_cache_gb=value)


def _bytes_per_block(cfg) -> int:
    mc, cc = cfg.model, cfg.cache
    return 2 * mc.num_layers * cc.block_size * mc.num_kv_heads * mc.head_dim * \
        torch.empty((), dtype=mc.dtype).element_size()


def test_cpu_kv_cache_holds_max_num_seqs_full_length_sequences() -> None:
    cfg = _config(max_model_len=100, max_num_seqs=3, block_size=16)
    per_block = _bytes_per_block(cfg)
    # 100 tokens = 7 blocks of 16 per sequence, 3 sequences; plenty of memory.
    assert cpu_num_blocks(cfg, per_block, available=64 * GiB) == 21


def test_cpu_kv_cache_is_capped_at_a_quarter_of_the_available_memory() -> None:
    cfg = _config(max_model_len=64, max_num_seqs=256, block_size=16)
    per_block = _bytes_per_block(cfg)
    available = 40 * per_block  # a quarter of it holds 10 blocks; 4 blocks per sequence
    assert cpu_num_blocks(cfg, per_block, available=available) == 10


def test_cpu_kv_cache_never_holds_less_than_one_full_length_sequence() -> None:
    cfg = _config(max_model_len=64, max_num_seqs=8, block_size=16)
    per_block = _bytes_per_block(cfg)
    assert cpu_num_blocks(cfg, per_block, available=per_block) == 4


def test_cpu_kv_cache_gb_is_an_explicit_override() -> None:
    cfg = _config(max_model_len=64, max_num_seqs=1, cpu_kv_cache_gb=0.01)
    per_block = _bytes_per_block(cfg)
    assert cpu_num_blocks(cfg, per_block, available=64 * GiB) == int(0.01 * GiB) // per_block


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux's /proc")
def test_cpu_kv_blocks_cost_resident_memory_only_once_written() -> None:
    cfg = _config(dtype="bfloat16")
    mc = cfg.model
    per_block = _bytes_per_block(cfg)
    num_blocks = (256 << 20) // per_block  # 256 MiB over every layer's K and V
    before = _rss_bytes()
    kv = allocate_kv_caches(mc, num_blocks, 16, torch.device("cpu"))
    allocated = _rss_bytes() - before
    assert allocated < (32 << 20), f"allocating grew the resident set by {allocated >> 20} MiB"
    k, v = kv[0]
    assert k.shape == (num_blocks, 16, mc.num_kv_heads, mc.head_dim) and k.dtype == torch.bfloat16
    assert len(kv) == mc.num_layers and k.data_ptr() != v.data_ptr()
    k[5].fill_(1.5)
    v[-1].fill_(-2.0)
    assert float(k[5].float().mean()) == 1.5 and float(v[-1].float().mean()) == -2.0
    assert not k[4].any() and not k[6].any() and not v[-2].any()
    assert not kv[1][0].any()  # reading zeros everywhere still commits no written pages


def test_model_folder_without_config_json_says_so(tmp_path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()


def _weights_without_tokenizer(tmp_path: Path) -> Path:
    src = Path(tiny_checkpoint("llama"))
    dst = tmp_path / "no-tokenizer"
    dst.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    return dst


def test_model_folder_without_tokenizer_files_names_skip_tokenizer_init(tmp_path) -> None:
    folder = _weights_without_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="no tokenizer files.*--skip-tokenizer-init") as info:
        EngineArgs(model=str(folder), device="cpu").create_engine_config()
    assert "\n" not in str(info.value) and "sentencepiece" not in str(info.value)
    cfg = EngineArgs(model=str(folder), device="cpu",
                     skip_tokenizer_init=True).create_engine_config()
    assert cfg.model.skip_tokenizer_init
    # A tokenizer from elsewhere is fine too.
    cfg = EngineArgs(model=str(folder), tokenizer=str(tiny_checkpoint("llama")),
                     device="cpu").create_engine_config()
    assert cfg.model.tokenizer == str(tiny_checkpoint("llama"))


def test_a_tokenizer_folder_without_tokenizer_files_is_refused(tmp_path) -> None:
    empty = tmp_path / "tok"
    empty.mkdir()
    (empty / "tokenizer_config.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match="tokenizer folder .* no tokenizer files"):
        EngineArgs(model=str(tiny_checkpoint("llama")), tokenizer=str(empty),
                   device="cpu").create_engine_config()


_BLOCK_TRITON = """
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTriton())
from peregrine import LLM, SamplingParams
llm = LLM(model=sys.argv[1], device="cpu", max_model_len=64, dtype="float32")
out = llm.generate(["hello world"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4, out
print("triton modules:", sorted(m for m in sys.modules if m.split(".")[0] == "triton"))
"""


@pytest.mark.slow
def test_the_cpu_engine_runs_without_triton_installed(tmp_path) -> None:
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _BLOCK_TRITON, str(tiny_checkpoint("llama"))],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "triton modules: []" in proc.stdout


def test_swap_space_holds_at_most_what_max_num_seqs_full_sequences_can_use() -> None:
    from peregrine.attention.kv_dtype import kv_cache_bytes_per_block
    small = _config(swap_space=4, max_num_seqs=3, max_model_len=100, block_size=16)
    assert small.cache.num_cpu_blocks == 3 * 7  # 3 sequences x ceil(100 / 16) blocks
    tight = _config(swap_space=0.001, max_num_seqs=256, max_model_len=128, block_size=16)
    per_block = kv_cache_bytes_per_block(tight.cache, tight.model)
    assert tight.cache.num_cpu_blocks == int(0.001 * 2**30) // per_block < 256 * 8
    assert _config(swap_space=4, preemption_mode="recompute").cache.num_cpu_blocks == 0
