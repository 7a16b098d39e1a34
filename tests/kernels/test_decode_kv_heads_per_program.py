"""The decode split kernel's kv_heads_per_program option: one program reads several adjacent kv
heads of a sequence (the "fma" variant) and must give exactly what one head a program gives."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import (FP8_E5M2_SLOW, K_SCALE, TOLERANCES, V_SCALE, exact_reference, fp8_case,
                          make_paged_case)
from peregrine.kernels.decode_attention import paged_decode_attention

SCALE = 0.125


def _run(case, **kwargs) -> torch.Tensor:
    return paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_table,
                                  case.seq_lens, SCALE, variant="fma", **kwargs)


def _with_padding_sequence(case):
    seq_lens = case.seq_lens.clone()
    seq_lens[1] = 0  # a CUDA-graph padding slot
    return case._replace(seq_lens=seq_lens)


# (GQA group, kv heads, kv heads per program, head dim)
SHAPES = [(1, 4, 2, 64), (2, 4, 4, 128), (4, 4, 2, 64), (2, 8, 4, 64), (3, 4, 2, 40)]
SHAPE_IDS = [f"g{g}-kv{kv}-x{h}-d{d}" for g, kv, h, d in SHAPES]
# (prefetch, clamp_tokens, aligned, heads_first)
OPTIONS = [(False, False, False, False), (True, True, True, True), (True, False, True, False),
           (False, True, False, True)]
OPTION_IDS = ["plain", "all", "prefetch-aligned", "clamp-heads-first"]


@pytest.mark.parametrize("cache_dtype", FP8_E5M2_SLOW)
@pytest.mark.parametrize("group,kv_heads,per_program,head_dim", SHAPES, ids=SHAPE_IDS)
def test_fp8_cache_is_exact_on_the_dequantized_cache(cache_dtype: torch.dtype, group: int,
                                                     kv_heads: int, per_program: int,
                                                     head_dim: int) -> None:
    """fp32 queries over FP8 caches with K/V scales: a padding sequence gives zeros, several
    splits end mid-tile and mid-block, windows start mid-tile and skip whole splits; exact
    against attention on the dequantized cache."""
    case = _with_padding_sequence(make_paged_case([20, 1, 75, 33], [1, 1, 1, 1],
                                                  group * kv_heads, kv_heads,
                                                  head_dim=head_dim, seed=group))
    quant, deq = fp8_case(case, cache_dtype)
    for window in (None, 30):
        out = _run(quant, split_len=32, window=window, kv_heads_per_program=per_program,
                   k_scale=K_SCALE, v_scale=V_SCALE)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out[[0, 2, 3]], exact_reference(deq, SCALE, window)[[0, 2, 3]],
                                   atol=1e-5, rtol=1e-5, msg=f"window {window}")


@pytest.mark.parametrize("prefetch,clamp,aligned,heads_first", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("cache", ["bf16", "e4m3"])
def test_every_option_matches_reference(prefetch: bool, clamp: bool, aligned: bool,
                                        heads_first: bool, cache: str) -> None:
    """bf16 queries, GQA 2:1 over 4 kv heads read 2 at a time, with the other options of the
    split kernel on and off; a window that starts mid-tile."""
    case = make_paged_case([9, 47, 70], [1, 1, 1], 8, 4, head_dim=32, dtype=torch.bfloat16)
    kw = dict(split_len=32, window=41, kv_heads_per_program=2, prefetch=prefetch,
              clamp_tokens=clamp, aligned=aligned, heads_first=heads_first)
    if cache == "bf16":
        quant = deq = case
    else:
        quant, deq = fp8_case(case, torch.float8_e4m3fn)
        kw.update(k_scale=K_SCALE, v_scale=V_SCALE)
    out = _run(quant, **kw)
    torch.testing.assert_close(out.float(), exact_reference(deq, SCALE, 41),
                               **TOLERANCES[torch.bfloat16])


def test_equals_one_head_a_program_with_the_default_split() -> None:
    """The default split length (from the smaller grid) and a tile smaller than a block of 32:
    the same answer as one kv head a program, which reads every head from its own offset."""
    case = make_paged_case([45, 100, 3], [1, 1, 1], 8, 4, head_dim=64, block_size=32)
    quant, _ = fp8_case(case, torch.float8_e5m2)
    one = _run(quant, k_scale=K_SCALE, v_scale=V_SCALE)
    for per_program in (2, 4):
        many = _run(quant, kv_heads_per_program=per_program, aligned=True,
                    k_scale=K_SCALE, v_scale=V_SCALE)
        torch.testing.assert_close(many, one, atol=1e-5, rtol=1e-5)


def test_refuses_what_it_cannot_run() -> None:
    """A kv head count it does not divide, a count that is not a power of two, another variant."""
    case = make_paged_case([9], [1], 6, 6, head_dim=16)
    with pytest.raises(ValueError, match="kv_heads_per_program 4 does not divide the 6 kv"):
        _run(case, kv_heads_per_program=4)
    with pytest.raises(ValueError, match="kv_heads_per_program must be a power of two.*3"):
        _run(case, kv_heads_per_program=3)
    with pytest.raises(ValueError, match="kv_heads_per_program must be a power of two.*0"):
        _run(case, kv_heads_per_program=0)
    with pytest.raises(ValueError, match="kv_heads_per_program 2 needs the 'fma' variant.*dot"):
        paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_table,
                               case.seq_lens, SCALE, variant="dot", kv_heads_per_program=2)
