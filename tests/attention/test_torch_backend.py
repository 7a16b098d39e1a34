from __future__ import annotations

import pytest
import torch

from peregrine.attention import AttentionBackend, get_attention_backend
from step_cases import TOLERANCES, make_step, naive_attention

SCALE = 0.125
# 2 decodes (one with a 1-token context), a chunk after a cached prefix, a fresh prefill.
MIXED = dict(prefix_lens=[0, 30, 21, 0], q_lens=[1, 1, 13, 9])


def _forward(step) -> torch.Tensor:
    return get_attention_backend("torch").forward(step.q, step.k, step.v, step.k_cache,
                                                  step.v_cache, step.meta, SCALE)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_mixed_batch_matches_naive_dense_attention(heads: tuple[int, int]) -> None:
    step = make_step(**MIXED, num_q_heads=heads[0], num_kv_heads=heads[1])
    out = _forward(step)
    torch.testing.assert_close(out, naive_attention(step, SCALE), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("block_size", [1, 2, 8, 128])
def test_any_power_of_two_block_size(block_size: int) -> None:
    step = make_step(**MIXED, block_size=block_size)
    torch.testing.assert_close(_forward(step), naive_attention(step, SCALE),
                               **TOLERANCES[torch.float32])


def test_bf16_keeps_dtype_and_matches_fp32_oracle() -> None:
    step = make_step(**MIXED, dtype=torch.bfloat16)
    out = _forward(step)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), naive_attention(step, SCALE),
                               **TOLERANCES[torch.bfloat16])


def test_new_tokens_are_stored_and_padding_is_not() -> None:
    step = make_step(**MIXED, num_pad_tokens=3)
    _forward(step)
    assert torch.equal(step.k_cache, step.expected_k_cache)
    assert torch.equal(step.v_cache, step.expected_v_cache)


def test_padding_rows_are_zero_and_real_rows_unaffected() -> None:
    step = make_step(**MIXED, num_pad_tokens=3)
    out = _forward(step)
    n = step.meta.num_actual_tokens
    assert out.shape == step.q.shape
    assert torch.all(out[n:] == 0)
    torch.testing.assert_close(out[:n], naive_attention(step, SCALE), atol=1e-5, rtol=1e-5)


def test_works_without_host_copies() -> None:
    step = make_step(**MIXED)
    step.meta.seq_lens_cpu = step.meta.query_start_loc_cpu = None
    torch.testing.assert_close(_forward(step), naive_attention(step, SCALE), atol=1e-5, rtol=1e-5)


def test_decode_only_batch() -> None:
    step = make_step(prefix_lens=[4, 40, 15], q_lens=[1, 1, 1])
    torch.testing.assert_close(_forward(step), naive_attention(step, SCALE), atol=1e-5, rtol=1e-5)


def test_debug_checks_reject_mismatched_shapes(monkeypatch) -> None:
    monkeypatch.setenv("PEREGRINE_DEBUG_CHECKS", "1")
    step = make_step(**MIXED)
    with pytest.raises(ValueError, match="slot_mapping"):
        get_attention_backend("torch").forward(step.q[:-1], step.k[:-1], step.v[:-1],
                                               step.k_cache, step.v_cache, step.meta, SCALE)


def test_shape_checks_are_off_the_hot_path_by_default(monkeypatch) -> None:
    import peregrine.attention.backend as backend_mod
    monkeypatch.delenv("PEREGRINE_DEBUG_CHECKS", raising=False)
    calls = []
    monkeypatch.setattr(backend_mod, "check_shapes", lambda *a: calls.append(a))
    step = make_step(**MIXED)
    torch.testing.assert_close(_forward(step), naive_attention(step, SCALE), atol=1e-5, rtol=1e-5)
    assert calls == []
    monkeypatch.setenv("PEREGRINE_DEBUG_CHECKS", "1")
    _forward(make_step(**MIXED))
    assert len(calls) == 1


def test_get_attention_backend_by_name() -> None:
    for name in ("torch", "triton"):
        backend = get_attention_backend(name)
        assert isinstance(backend, AttentionBackend) and backend.name == name
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")
