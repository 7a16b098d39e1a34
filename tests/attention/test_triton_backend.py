from __future__ import annotations

import pytest
import torch

from peregrine.attention import get_attention_backend
from step_cases import TOLERANCES, make_step, naive_attention

SCALE = 0.125
MIXED = dict(prefix_lens=[0, 30, 21, 0], q_lens=[1, 1, 13, 9])


def _forward(step, meta=None) -> torch.Tensor:
    return get_attention_backend("triton").forward(step.q, step.k, step.v, step.k_cache,
                                                   step.v_cache, meta or step.meta, SCALE)


@pytest.mark.parametrize("fold", [0, 8], ids=["decode-kernel", "decodes-in-extend"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_mixed_batch_matches_naive(dtype: torch.dtype, heads: tuple[int, int], fold: int,
                                   monkeypatch) -> None:
    from peregrine.attention.triton_backend import TritonAttentionBackend
    monkeypatch.setattr(TritonAttentionBackend, "fold_decodes_max", fold)
    step = make_step(**MIXED, num_q_heads=heads[0], num_kv_heads=heads[1], dtype=dtype)
    out = _forward(step)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), naive_attention(step, SCALE), **TOLERANCES[dtype])


def test_head_dim_128_bf16_mixed() -> None:
    step = make_step(prefix_lens=[17, 12], q_lens=[1, 8], head_dim=128, dtype=torch.bfloat16)
    torch.testing.assert_close(_forward(step).float(), naive_attention(step, SCALE),
                               **TOLERANCES[torch.bfloat16])


def test_many_decodes_beside_a_chunk_use_the_decode_kernel() -> None:
    from peregrine.attention.triton_backend import TritonAttentionBackend
    n = TritonAttentionBackend.fold_decodes_max + 2
    step = make_step(prefix_lens=[3 * i + 1 for i in range(n)] + [5], q_lens=[1] * n + [6])
    torch.testing.assert_close(_forward(step), naive_attention(step, SCALE), atol=1e-5, rtol=1e-5)


def test_prefill_only_batch() -> None:
    step = make_step(prefix_lens=[0, 16], q_lens=[20, 7])
    torch.testing.assert_close(_forward(step), naive_attention(step, SCALE), atol=1e-5, rtol=1e-5)


def test_small_block_size() -> None:
    step = make_step(**MIXED, block_size=4)
    torch.testing.assert_close(_forward(step), naive_attention(step, SCALE), atol=1e-5, rtol=1e-5)


def test_padding_tokens_store_nothing_and_give_zero_rows() -> None:
    step = make_step(**MIXED, num_pad_tokens=3)
    out = _forward(step)
    n = step.meta.num_actual_tokens
    assert torch.equal(step.k_cache, step.expected_k_cache)
    assert torch.equal(step.v_cache, step.expected_v_cache)
    assert torch.all(out[n:] == 0)
    torch.testing.assert_close(out[:n], naive_attention(step, SCALE), atol=1e-5, rtol=1e-5)


class _DeviceOnlyMeta:
    """Forwards to real metadata but fails on any host-side field (CUDA-graph replay safety)."""

    _HOST_FIELDS = {"max_query_len", "max_seq_len", "query_start_loc_cpu", "seq_lens_cpu",
                    "num_actual_tokens"}

    def __init__(self, meta) -> None:
        self._meta = meta

    def __getattr__(self, name: str):
        if name in self._HOST_FIELDS:
            raise AssertionError(f"decode-only path read host metadata {name!r}")
        return getattr(self._meta, name)


def test_decode_only_batch_reads_no_host_metadata() -> None:
    # Two real decodes and one graph-padding sequence (seq_len 0, slot -1).
    step = make_step(prefix_lens=[4, 40, 0], q_lens=[1, 1, 1])
    step.meta.seq_lens[2] = 0
    step.meta.slot_mapping[2] = -1
    out = _forward(step, _DeviceOnlyMeta(step.meta))
    torch.testing.assert_close(out[:2], naive_attention(step, SCALE)[:2], atol=1e-5, rtol=1e-5)
    assert torch.all(out[2] == 0)
