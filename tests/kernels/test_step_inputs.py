"""One packed upload and one kernel write a step's inputs exactly as one copy per buffer does."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from peregrine.kernels.step_inputs import scatter_step_inputs
from peregrine.transfer import upload_packed
from peregrine.worker.step_buffers import StepBuffers

MAX_TOKENS, MAX_REQS, MAX_BLOCKS = 40, 8, 9
DEVICE_BUFFERS = ("d_input_ids", "d_positions", "d_slot_mapping", "d_seq_lens",
                  "d_query_start_loc", "d_block_table")


def _pair(seed: int) -> tuple[StepBuffers, StepBuffers]:
    """Two step buffers, packed and not, with the same host arrays and the same stale device
    contents (what an earlier, larger step left)."""
    rng = np.random.default_rng(seed)
    bufs = [StepBuffers(MAX_TOKENS, MAX_REQS, MAX_BLOCKS, torch.device("cpu"), packed=p)
            for p in (True, False)]
    host = {"input_ids_np": rng.integers(0, 2**40, MAX_TOKENS),
            "positions_np": rng.integers(0, 5000, MAX_TOKENS),
            "slot_mapping_np": rng.integers(-1, 2**33, MAX_TOKENS),
            "seq_lens_np": rng.integers(1, 5000, MAX_REQS).astype(np.int32),
            "query_start_loc_np": np.sort(rng.integers(0, MAX_TOKENS, MAX_REQS + 1)).astype(np.int32),
            "block_table_np": rng.integers(0, 2**31 - 1, (MAX_REQS, MAX_BLOCKS)).astype(np.int32)}
    gen = torch.Generator().manual_seed(seed)
    for name in DEVICE_BUFFERS:
        stale = torch.randint(-2**31, 2**31 - 1, getattr(bufs[0], name).shape, generator=gen)
        for buf in bufs:
            getattr(buf, name).copy_(stale)
    for buf in bufs:
        for name, value in host.items():
            getattr(buf, name)[...] = value
    return bufs[0], bufs[1]


def _assert_same(packed: StepBuffers, plain: StepBuffers, outs_packed, outs_plain) -> None:
    for name in DEVICE_BUFFERS:
        assert torch.equal(getattr(packed, name), getattr(plain, name)), name
    ids_p, pos_p, meta_p = outs_packed
    ids_c, pos_c, meta_c = outs_plain
    assert torch.equal(ids_p, ids_c) and torch.equal(pos_p, pos_c)
    for field in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        assert torch.equal(getattr(meta_p, field), getattr(meta_c, field)), field


@pytest.mark.parametrize("t,b,width,pad_t,pad_b", [
    (1, 1, 1, None, None),          # one decode
    (5, 5, 3, 8, 8),                # a padded decode batch
    (37, 3, 9, None, None),         # a prefill: every block-table column
    (12, 4, 0, 16, None),           # no block-table columns yet
])
def test_packed_upload_matches_a_copy_per_buffer(t, b, width, pad_t, pad_b) -> None:
    packed, plain = _pair(t * 31 + b)
    outs = [buf.to_device(t, b, width, pad_t=pad_t, pad_b=pad_b) for buf in (packed, plain)]
    _assert_same(packed, plain, *outs)
    # what the step did not send stays as it was (the block table's other rows and columns)
    assert torch.equal(packed.d_block_table[b:], plain.d_block_table[b:])


@pytest.mark.parametrize("dst,src,n", [(0, 0, 1), (2, 5, 3), (0, 0, 8), (7, 0, 1)])
def test_sampled_tokens_replace_their_placeholders(dst, src, n) -> None:
    packed, plain = _pair(dst * 7 + src + n)
    sampled = torch.randint(0, 2**40, (9,), generator=torch.Generator().manual_seed(n))
    outs = [buf.to_device(8, 8, 2, pending=(sampled, dst, src, n)) for buf in (packed, plain)]
    _assert_same(packed, plain, *outs)
    assert torch.equal(packed.d_input_ids[dst:dst + n], sampled[src:src + n])
    host = torch.from_numpy(packed.input_ids_np[:8])
    keep = torch.ones(8, dtype=torch.bool)
    keep[dst:dst + n] = False
    assert torch.equal(packed.d_input_ids[:8][keep], host[keep])


def test_bad_arguments_are_refused() -> None:
    buf = StepBuffers(8, 2, 4, torch.device("cpu"), packed=True)
    dsts = [buf.d_input_ids, buf.d_positions, buf.d_slot_mapping, buf.d_seq_lens,
            buf.d_query_start_loc, buf.d_block_table]
    arrays = [buf.input_ids_np[:2], buf.positions_np[:2], buf.slot_mapping_np[:2],
              buf.seq_lens_np[:1], buf.query_start_loc_np[:2], buf.block_table_np[:1, :2]]
    packed, offsets = upload_packed(arrays, torch.device("cpu"))
    with pytest.raises(ValueError, match="buffers and offsets"):
        scatter_step_inputs(packed, offsets[:5], dsts, 2, 1, 1, 2)
    with pytest.raises(ValueError, match="larger than its buffer"):
        scatter_step_inputs(packed, offsets, dsts, 9, 1, 1, 2)
    with pytest.raises(ValueError, match="do not fit"):
        scatter_step_inputs(packed, offsets, dsts, 2, 1, 1, 2,
                            pending=(torch.zeros(4, dtype=torch.int64), 1, 0, 2))
    with pytest.raises(ValueError, match="int64"):
        scatter_step_inputs(packed, offsets, dsts, 2, 1, 1, 2,
                            pending=(torch.zeros(4, dtype=torch.int32), 0, 0, 1))
    with pytest.raises(ValueError, match="aligned"):
        scatter_step_inputs(packed, [0, 4, 8, 16, 24, 32], dsts, 2, 1, 1, 2)


def test_engine_tokens_are_the_same_with_packed_step_inputs(monkeypatch) -> None:
    """The demo model's greedy and seeded tokens through the engine (prefill chunks, mixed and
    decode steps) with packed inputs, as on a GPU, equal those with a copy per buffer. (A CPU
    step has finished when the next is planned, so its tokens come from the host: the sampled
    tokens' path is checked above and on the GPU.)"""
    from peregrine import LLM, SamplingParams
    from peregrine.kernels import step_inputs
    from peregrine.worker import step_buffers

    prompts = ["The capital of France is a city that lies on the river Seine, and it is", "1 2 3",
               "Once upon a time"]
    params = [SamplingParams(temperature=0.0, max_tokens=12),
              SamplingParams(temperature=0.8, seed=7, max_tokens=12),
              SamplingParams(temperature=0.0, max_tokens=5)]
    init = step_buffers.StepBuffers.__init__
    scatter = step_inputs.scatter_step_inputs
    runs, calls = {}, []

    def counted(*args, **kwargs):
        calls.append(args[3])  # the step's tokens
        return scatter(*args, **kwargs)

    monkeypatch.setattr(step_inputs, "scatter_step_inputs", counted)
    for packed in (False, True):
        monkeypatch.setattr(step_buffers.StepBuffers, "__init__",
                            lambda self, *a, _p=packed, **k: init(self, *a, packed=_p, **k))
        llm = LLM(device="cpu", block_size=16, max_num_batched_tokens=16, dtype="float32",
                  async_scheduling=True)
        calls.clear()
        runs[packed] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
    assert len(calls) >= 12 and 16 in calls and min(calls) <= 3, calls  # every step, packed
    assert runs[True] == runs[False]
    assert all(len(t) == p.max_tokens for t, p in zip(runs[True], params))
