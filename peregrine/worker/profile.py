"""A worst-case forward + sampling pass, to measure peak activation memory before sizing the KV pool."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from peregrine.config import ModelConfig
from peregrine.worker.kv_memory import allocate_kv_caches
from peregrine.worker.step_buffers import StepBuffers


@torch.inference_mode()
def profile_run(model: nn.Module, buffers: StepBuffers, model_config: ModelConfig,
                num_tokens: int, max_num_seqs: int, block_size: int,
                num_sampled_rows: int = 0) -> None:
    """Run num_tokens tokens split over up to max_num_seqs sequences, then sample all of them
    (or `num_sampled_rows` logits rows when more: speculative verify steps sample k + 1 rows per
    sequence)."""
    # NOTE: no sequence holds more than max_model_len tokens, so a budget above
    # max_num_seqs x max_model_len cannot be filled (and would not fit the block table).
    t = min(num_tokens, max_num_seqs * model_config.max_model_len)
    b = min(max_num_seqs, t)
    q_lens = np.full(b, t // b, np.int64)
    q_lens[: t % b] += 1
    blocks_per_seq = -(-int(q_lens.max()) // block_size)
    # NOTE: the profile writes no KV, so the cache dtype does not change its peak.
    caches = allocate_kv_caches(model_config, b * blocks_per_seq, block_size, buffers.device)
    buf = buffers
    qsl = np.zeros(b + 1, np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    positions = np.arange(t) - np.repeat(qsl[:-1], q_lens)
    buf.input_ids_np[:t] = 0
    buf.positions_np[:t] = positions
    buf.slot_mapping_np[:t] = -1  # the profile writes no KV
    width = blocks_per_seq
    buf.block_table_np[:b, :width] = np.arange(b * width, dtype=np.int32).reshape(b, width)
    buf.seq_lens_np[:b] = q_lens
    buf.query_start_loc_np[: b + 1] = qsl
    input_ids, pos, meta = buf.to_device(t, b, width)
    meta.num_decodes = 0
    meta.max_query_len = int(q_lens.max())
    meta.max_seq_len = int(q_lens.max())
    stage = getattr(model, "stage", None)
    if stage is not None and not stage.is_first:
        # A later pipeline stage starts from the previous one's (hidden, residual).
        shape = (2, t, model_config.hidden_size)
        intermediate = torch.zeros(shape, dtype=model_config.dtype, device=buffers.device)
        hidden = model(input_ids, pos, caches, meta, intermediate)  # (T, hidden) or (2, T, hidden)
    else:
        hidden = model(input_ids, pos, caches, meta)
    if stage is None or stage.is_last:
        logits = model.compute_logits(hidden[:min(t, max(b, num_sampled_rows))])  # (B, V)
        # Sorting for top-p is the sampler's largest buffer.
        torch.sort(logits, dim=-1, descending=True)
    del caches
