from __future__ import annotations

import pytest
import torch

from kernel_cases import (FP8_DTYPES, FP8_IDS, K_SCALE, TOLERANCES, V_SCALE, exact_reference,
                          fp8_case, fp8_error_bounds, make_paged_case)
from peregrine.kernels.extend_attention import extend_attention

SCALE = 0.125


def _run(case, **kwargs) -> torch.Tensor:
    return extend_attention(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens,
                            case.query_start_loc, SCALE, case.max_query_len, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_extend_matches_reference_with_prefixes(dtype: torch.dtype,
                                                heads: tuple[int, int]) -> None:
    # A fresh prefill, a chunk after a 21-token prefix (crosses blocks), and a single token.
    case = make_paged_case([19, 40, 9], [19, 19, 1], *heads, dtype=dtype)
    out = _run(case)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), exact_reference(case, SCALE), **TOLERANCES[dtype])


def test_extend_head_dim_128_bf16() -> None:
    case = make_paged_case([30, 25], [14, 25], 4, 2, head_dim=128, dtype=torch.bfloat16)
    torch.testing.assert_close(_run(case).float(), exact_reference(case, SCALE),
                               **TOLERANCES[torch.bfloat16])


def test_extend_tile_sizes_do_not_change_the_result() -> None:
    case = make_paged_case([37, 20], [20, 20], 4, 2)
    ref = exact_reference(case, SCALE)
    for block_m, block_n in [(16, 16), (16, 32), (32, 16)]:
        out = _run(case, block_m=block_m, block_n=block_n)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_extend_small_block_size() -> None:
    case = make_paged_case([23, 13], [10, 13], 4, 1, block_size=4)
    torch.testing.assert_close(_run(case), exact_reference(case, SCALE), atol=1e-5, rtol=1e-5)


def test_extend_only_writes_rows_of_its_sequences() -> None:
    # Sequences 0 and 1 are decodes handled elsewhere: their rows must stay untouched.
    case = make_paged_case([8, 3, 30], [1, 1, 12], 4, 2)
    out = torch.full_like(case.q, 7.0)
    _run(case, out=out, seq_start=2)
    assert torch.all(out[:2] == 7.0)
    torch.testing.assert_close(out[2:], exact_reference(case, SCALE)[2:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 16, 21, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_sliding_window_matches_reference(window: int, dtype: torch.dtype) -> None:
    # A fresh prefill longer than most windows, a chunk after a prefix, a 1-token chunk; 16x16
    # tiles so a window edge falls inside a tile, on a tile boundary, and past the context.
    case = make_paged_case([40, 45, 9], [40, 19, 1], 4, 2, dtype=dtype)
    out = _run(case, window=window)
    torch.testing.assert_close(out.float(), exact_reference(case, SCALE, window),
                               **TOLERANCES[dtype])
    if window < 40:  # the window really changes the answer
        assert not torch.allclose(out.float(), exact_reference(case, SCALE), atol=1e-3)


def test_extend_rejects_a_bad_window() -> None:
    case = make_paged_case([8], [8], 4, 2)
    with pytest.raises(ValueError, match="window"):
        _run(case, window=0)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=FP8_IDS)
def test_extend_fp8_cache_equals_reference_on_dequantized_cache(cache_dtype: torch.dtype,
                                                                q_dtype: torch.dtype) -> None:
    # A fresh prefill, a chunk after a prefix, a single token; a sliding window on one run.
    case = make_paged_case([19, 40, 9], [19, 19, 1], 4, 2, dtype=q_dtype)
    quant, deq = fp8_case(case, cache_dtype)
    for window in (None, 7):
        out = _run(quant, k_scale=K_SCALE, v_scale=V_SCALE, window=window)
        assert out.dtype == q_dtype
        torch.testing.assert_close(out.float(), exact_reference(deq, SCALE, window),
                                   **TOLERANCES[q_dtype])
    out = _run(quant, k_scale=K_SCALE, v_scale=V_SCALE)
    max_err, mean_err = fp8_error_bounds(cache_dtype, case.v_cache)
    err = (out.float() - exact_reference(case, SCALE)).abs()
    assert err.max().item() <= max_err and err.mean().item() <= mean_err, (err.max(), err.mean())


def _fake_gpu_kernel(monkeypatch, jit_calls: list, launch) -> None:
    """Stand in for the compiled kernel's GPU: the JIT launch is recorded and returns a compiled
    kernel whose direct launch calls launch(grid, args) (the compiled launch exists only on a
    GPU)."""
    import peregrine.kernels.extend_attention as ext

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args: launch(grid, list(args))

    class FakeKernel:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                jit_calls.append((grid, list(args)))
                return Compiled()
            return run

    monkeypatch.setattr(ext, "_extend_kernel", FakeKernel())
    monkeypatch.setattr(ext, "is_gpu", lambda x: True)
    monkeypatch.setattr(ext, "may_reuse_launches", lambda x: True)
    monkeypatch.setattr(ext, "_reuse_launches", True)


def test_a_steps_later_layers_reuse_the_first_layers_launch(monkeypatch) -> None:
    """With a step's `launches` dict, the first layer's call binds and compiles through Triton;
    a later layer (other caches and scales, everything else equal) reuses that launch with its
    own caches and scales in place; any other difference binds afresh. Faked kernel: the
    compiled launch exists only on a GPU."""
    import math

    import peregrine.kernels.extend_attention as ext
    jit_calls, launched = [], []
    _fake_gpu_kernel(monkeypatch, jit_calls, lambda grid, args: launched.append((grid, args)))
    case = make_paged_case([37, 20], [20, 20], 4, 2)
    other = make_paged_case([37, 20], [20, 20], 4, 2)  # a second layer's caches
    out = torch.empty_like(case.q)
    launches: dict = {}

    def call(c, k_scale=1.0, v_scale=1.0, **kw):
        return ext.extend_attention(case.q, c.k_cache, c.v_cache, case.block_table, case.seq_lens,
                                    case.query_start_loc, SCALE, case.max_query_len, out=out,
                                    k_scale=k_scale, v_scale=v_scale, launches=launches, **kw)

    assert call(case) is out
    assert len(jit_calls) == 1 and not launched and len(launches) == 1
    grid, first = jit_calls[0]
    assert call(other, k_scale=0.5, v_scale=2.0) is out
    assert len(jit_calls) == 1 and len(launched) == 1
    reused_grid, args = launched[0]
    assert reused_grid == grid and len(args) == len(first)
    assert args[1] is other.k_cache and args[2] is other.v_cache
    assert args[7] == pytest.approx(SCALE * 0.5 * math.log2(math.e)) and args[8] == 2.0
    assert all(a is b for i, (a, b) in enumerate(zip(args, first)) if i not in (1, 2, 7, 8))
    call(other, window=8)  # a sliding-window layer: another kernel variant
    assert len(jit_calls) == 2 and len(launched) == 1
    ext.extend_attention(case.q, other.k_cache, other.v_cache, case.block_table, case.seq_lens,
                         case.query_start_loc, SCALE, case.max_query_len, out=out)
    assert len(jit_calls) == 3  # without the dict: no reuse


def test_a_launch_that_refuses_its_arguments_falls_back_to_the_jit(monkeypatch) -> None:
    import peregrine.kernels.extend_attention as ext
    jit_calls = []

    def refuse(grid, args):
        raise TypeError("function takes exactly 20 arguments (32 given)")

    _fake_gpu_kernel(monkeypatch, jit_calls, refuse)
    case = make_paged_case([37, 20], [20, 20], 4, 2)
    out = torch.empty_like(case.q)
    launches: dict = {}
    for _ in range(3):
        ext.extend_attention(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens,
                             case.query_start_loc, SCALE, case.max_query_len, out=out,
                             launches=launches)
    assert len(jit_calls) == 3 and not launches and not ext._reuse_launches
