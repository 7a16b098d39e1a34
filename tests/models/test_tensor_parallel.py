"""Tensor-parallel layers: a model split over 2 CPU processes (gloo) gives the unsplit model's logits."""
from __future__ import annotations


import pytest
import torch

from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.testing.gloo import run_on_gloo_ranks

WORLD = 2
TOKENS = [5, 17, 99, 230, 41, 8, 77, 301, 12, 64, 150, 9]


def _logits(path: str) -> torch.Tensor:
    """Logits of one prefill through the paged torch backend, built on whatever TP group is active."""
    from peregrine.attention import get_attention_backend
    from peregrine.config import EngineArgs
    from peregrine.distributed import tp_size
    from peregrine.worker.kv_memory import allocate_kv_caches
    from peregrine.worker.loader import load_model
    from peregrine.attention.metadata import AttentionMetadata
    import dataclasses

    cfg = EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config().model
    model = load_model(cfg, get_attention_backend("torch"), torch.device("cpu"))
    local = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads // tp_size())
    t = len(TOKENS)
    caches = allocate_kv_caches(local, 4, 16, torch.device("cpu"))
    qsl = torch.tensor([0, t], dtype=torch.int32)
    seq = torch.tensor([t], dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=t, num_decodes=0, max_query_len=t, max_seq_len=t,
        query_start_loc=qsl, seq_lens=seq, block_table=torch.zeros(1, 4, dtype=torch.int32),
        slot_mapping=torch.arange(t), query_start_loc_cpu=qsl, seq_lens_cpu=seq)
    with torch.inference_mode():
        hidden = model(torch.tensor(TOKENS), torch.arange(t), caches, meta)
        return model.compute_logits(hidden)  # (T, V)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_way_tensor_parallel_matches_single_process(arch: str) -> None:
    path = str(tiny_checkpoint(arch))
    want = _logits(path)
    got = run_on_gloo_ranks(_logits, WORLD, path)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
