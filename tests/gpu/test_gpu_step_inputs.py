"""On the GPU: a step's inputs through one packed upload and one kernel equal one copy per
buffer, step after step (the compiled launch reused with new sizes and sampled tokens)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from peregrine.worker.step_buffers import StepBuffers

pytestmark = pytest.mark.gpu

BUFFERS = ("d_input_ids", "d_positions", "d_slot_mapping", "d_seq_lens", "d_query_start_loc",
           "d_block_table")


def test_packed_step_inputs_match_copies_over_many_steps() -> None:
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    bufs = [StepBuffers(512, 64, 128, dev, packed=p) for p in (True, False)]
    sampled = torch.randint(0, 2**40, (64,), device=dev)
    # decode batches (padded, with sampled tokens), prefills, one decode, a wide block table
    steps = [(1, 1, 1, 1, 1), (5, 5, 3, 8, 8), (300, 3, 100, 512, None), (1, 1, 128, 1, 1),
             (64, 64, 7, 64, 64), (17, 2, 2, 32, None), (1, 1, 1, 1, 1)]
    for i, (t, b, width, pad_t, pad_b) in enumerate(steps * 3):
        host = {"input_ids_np": rng.integers(0, 2**40, 512),
                "positions_np": rng.integers(0, 8192, 512),
                "slot_mapping_np": rng.integers(-1, 2**33, 512),
                "seq_lens_np": rng.integers(1, 8192, 64).astype(np.int32),
                "query_start_loc_np": np.sort(rng.integers(0, 512, 65)).astype(np.int32),
                "block_table_np": rng.integers(0, 2**31 - 1, (64, 128)).astype(np.int32)}
        pending = (sampled, 0, i % 3, t) if t == b and t + 2 <= 64 else None
        for buf in bufs:
            for name, value in host.items():
                getattr(buf, name)[...] = value
            buf.to_device(t, b, width, pad_t=pad_t, pad_b=pad_b, pending=pending)
        torch.cuda.synchronize()
        for name in BUFFERS:
            assert torch.equal(getattr(bufs[0], name), getattr(bufs[1], name)), (i, name)
        if pending is not None:
            assert torch.equal(bufs[0].d_input_ids[:t], sampled[i % 3:i % 3 + t])
