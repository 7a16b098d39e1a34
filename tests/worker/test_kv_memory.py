"""KV pool sizing on CUDA, from the numbers passed in: the cap at what max_num_seqs sequences of
max_model_len tokens can use, and what it leaves alone."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from peregrine.attention.kv_dtype import kv_cache_bytes_per_block
from peregrine.config import EngineArgs
from peregrine.entrypoints.model_path import model_folder
from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.worker import kv_memory
from peregrine.worker.kv_memory import (GiB, capped_gpu_blocks, cpu_num_blocks,
                                        determine_num_blocks, full_batch_blocks, gpu_blocks_cap)

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda")  # only named: the profile is replaced, nothing touches a GPU


def _config(**kw):
    return EngineArgs(model=str(tiny_checkpoint("llama")), device="cpu", **kw).create_engine_config()


def _gpu_blocks(cfg, room: int, monkeypatch) -> int:
    """determine_num_blocks on CUDA when the profiled memory budget holds `room` blocks."""
    monkeypatch.setattr(kv_memory, "_profile_gpu_blocks", lambda *a, **k: room)
    return determine_num_blocks(cfg, CUDA, lambda: None)


def test_the_cap_is_a_full_batch_plus_one_block_per_sequence() -> None:
    cfg = _config(max_model_len=100, max_num_seqs=3, block_size=16)
    assert full_batch_blocks(cfg) == 3 * 7  # 100 tokens are 7 blocks of 16
    assert gpu_blocks_cap(cfg) == 3 * 7 + 3


def test_a_small_model_takes_only_the_capped_pool(monkeypatch, caplog) -> None:
    cfg = _config(max_model_len=64, max_num_seqs=8, block_size=16)
    with caplog.at_level(logging.INFO, logger="peregrine"):
        assert _gpu_blocks(cfg, 2_000_000, monkeypatch) == 8 * 4 + 8
    assert any("KV cache capped at 40 blocks (max_num_seqs 8 x max_model_len 64" in r.getMessage()
               and "room for 2000000" in r.getMessage() for r in caplog.records)


def test_a_budget_below_the_cap_is_used_whole(monkeypatch, caplog) -> None:
    cfg = _config(max_model_len=64, max_num_seqs=8, block_size=16)
    with caplog.at_level(logging.INFO, logger="peregrine"):
        assert _gpu_blocks(cfg, 39, monkeypatch) == 39
        assert capped_gpu_blocks(cfg, 40) == 40
    assert not any("capped" in r.getMessage() for r in caplog.records)


def test_num_gpu_blocks_override_is_not_capped(monkeypatch) -> None:
    cfg = _config(max_model_len=64, max_num_seqs=8, num_gpu_blocks_override=1000)
    monkeypatch.setattr(kv_memory, "_profile_gpu_blocks", pytest.fail)  # no profile either
    assert determine_num_blocks(cfg, CUDA, lambda: None) == 1000


def test_a_budget_below_one_full_length_sequence_is_still_refused(monkeypatch) -> None:
    cfg = _config(max_model_len=64, max_num_seqs=8, block_size=16)
    with pytest.raises(ValueError, match="max_model_len=64 needs 64"):
        _gpu_blocks(cfg, 3, monkeypatch)


def test_an_8b_model_at_256_sequences_of_8192_tokens_is_not_capped_on_a_141_gib_gpu(
        monkeypatch) -> None:
    cfg = EngineArgs(model=model_folder(str(REPO / "benchmarks/configs/llama-3-8b.json")),
                     load_format="dummy", skip_tokenizer_init=True, device="cpu",
                     max_model_len=8192, max_num_seqs=256, dtype="bfloat16").create_engine_config()
    per_block = kv_cache_bytes_per_block(cfg.cache, cfg.model)
    assert per_block == 2 * 32 * 16 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    budget = int(141 * GiB * 0.9) - 16 * GiB - 4 * GiB  # weights, activations
    room = budget // per_block
    assert room < gpu_blocks_cap(cfg)
    assert _gpu_blocks(cfg, room, monkeypatch) == room


def test_the_cpu_pool_still_holds_exactly_a_full_batch() -> None:
    cfg = _config(max_model_len=100, max_num_seqs=3, block_size=16)
    assert cpu_num_blocks(cfg, 1024, available=64 * GiB) == full_batch_blocks(cfg) == 21
