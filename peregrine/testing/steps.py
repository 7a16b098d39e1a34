"""One prefill step's inputs for driving a model directly in tests, without the engine."""
from __future__ import annotations

import torch

from peregrine.attention.metadata import AttentionMetadata
from peregrine.config import ModelConfig

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def one_prefill(cfg: ModelConfig, n: int, num_blocks: int = 4,
                block_size: int = 16) -> tuple[KVCaches, AttentionMetadata]:
    """Empty per-layer K/V pools (this rank's kv heads) and the metadata of one n-token prefill."""
    from peregrine.distributed import tp_size
    if n > num_blocks * block_size:
        raise ValueError(f"{n} tokens do not fit {num_blocks} blocks of {block_size}")
    shape = (num_blocks, block_size, cfg.num_kv_heads // tp_size(), cfg.head_dim)
    caches = [(torch.zeros(shape, dtype=cfg.dtype), torch.zeros(shape, dtype=cfg.dtype))
              for _ in range(cfg.num_layers)]
    qsl = torch.tensor([0, n], dtype=torch.int32)  # (2,)
    seq = torch.tensor([n], dtype=torch.int32)  # (1,)
    meta = AttentionMetadata(
        num_actual_tokens=n, num_decodes=0, max_query_len=n, max_seq_len=n, query_start_loc=qsl,
        seq_lens=seq, block_table=torch.arange(num_blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(n), query_start_loc_cpu=qsl, seq_lens_cpu=seq)
    return caches, meta


def prefill_logits(path: str, tokens: list[int], **engine_args) -> torch.Tensor:
    """(len(tokens), V) float32 logits of one prefill of `tokens` through the model at `path`
    (float32, CPU, torch attention backend; tensor-parallel when a gloo group is set)."""
    from peregrine.attention import get_attention_backend
    from peregrine.config import EngineArgs
    from peregrine.worker.loader import load_model
    engine_args = {"skip_tokenizer_init": True, **engine_args}  # token ids only
    cfg = EngineArgs(model=path, dtype="float32", device="cpu",
                     **engine_args).create_engine_config().model
    model = load_model(cfg, get_attention_backend("torch"), torch.device("cpu"))
    caches, meta = one_prefill(cfg, len(tokens))
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), caches, meta)
        return model.compute_logits(hidden)
