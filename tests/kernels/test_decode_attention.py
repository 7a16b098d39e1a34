from __future__ import annotations

import inspect
import math

import pytest
import torch

from kernel_cases import (FP8_DTYPES, FP8_E5M2_SLOW, FP8_IDS, K_SCALE, TOLERANCES, V_SCALE,
                          exact_reference, fp8_case, fp8_error_bounds, make_paged_case)
from peregrine.kernels.decode_attention import (FP8_ONLY_VARIANTS, GPU_ONLY_VARIANTS, VARIANTS,
                                                decode_num_splits, paged_decode_attention,
                                                pick_config)

SCALE = 0.125


def _run(case, **kwargs) -> torch.Tensor:
    return paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_table,
                                  case.seq_lens, SCALE, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_decode_matches_reference_across_splits(dtype: torch.dtype, heads: tuple[int, int]) -> None:
    # 3 sequences: 1 token, a partial split, several splits with a partial last tile.
    case = make_paged_case([1, 30, 71], [1, 1, 1], *heads, dtype=dtype)
    out = _run(case, split_len=32)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), exact_reference(case, SCALE), **TOLERANCES[dtype])


def test_decode_head_dim_128_bf16() -> None:
    case = make_paged_case([17, 40], [1, 1], 4, 2, head_dim=128, dtype=torch.bfloat16)
    out = _run(case, split_len=16)
    torch.testing.assert_close(out.float(), exact_reference(case, SCALE),
                               **TOLERANCES[torch.bfloat16])


def test_decode_result_does_not_depend_on_split_len() -> None:
    case = make_paged_case([5, 64], [1, 1], 4, 2, extra_width=4)
    one_split = _run(case, split_len=case.block_table.shape[1] * 16)
    many = _run(case, split_len=16)
    default = _run(case)
    torch.testing.assert_close(many, one_split, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(default, one_split, atol=1e-5, rtol=1e-5)


def test_decode_small_block_size() -> None:
    case = make_paged_case([9, 23], [1, 1], 4, 1, block_size=4)
    torch.testing.assert_close(_run(case, split_len=16), exact_reference(case, SCALE),
                               **TOLERANCES[torch.float32])


def test_decode_empty_sequence_gives_zeros() -> None:
    case = make_paged_case([20, 1], [1, 1], 4, 2)
    seq_lens = case.seq_lens.clone()
    seq_lens[1] = 0  # a CUDA-graph padding slot: no context at all
    out = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_table, seq_lens,
                                 SCALE, split_len=16)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[0], exact_reference(case, SCALE)[0], atol=1e-5, rtol=1e-5)


def test_decode_writes_into_a_strided_out_view() -> None:
    case = make_paged_case([12, 33], [1, 1], 4, 4)
    full = torch.full((5, 4, 64), 7.0)
    _run(case, out=full[1:3], split_len=16)
    torch.testing.assert_close(full[1:3], exact_reference(case, SCALE), atol=1e-5, rtol=1e-5)
    assert torch.all(full[0] == 7.0) and torch.all(full[3:] == 7.0)


def test_num_splits_depends_only_on_shapes() -> None:
    cpu = torch.device("cpu")
    a = decode_num_splits(8, 2, 512, 16, cpu)
    assert 1 <= a <= 32  # a table of 8,192 tokens: splits of at least 256 tokens
    assert decode_num_splits(8, 2, 512, 16, cpu) == a
    assert decode_num_splits(1, 1, 512, 16, cpu) >= a  # fewer programs -> more splits
    assert decode_num_splits(10_000, 8, 512, 16, cpu) == 1
    assert decode_num_splits(1, 1, 4, 16, cpu) == 1  # a 64-token table is never split


def test_small_batches_split_shorter_contexts() -> None:
    """Where a batch's kv rows are fewer than the SMs, splits may be as short as one tile, so
    batch-1 decode spreads a short context over more programs; larger batches keep the longer
    splits (the merge costs more than the parallelism wins there)."""
    from peregrine.kernels.decode_attention import decode_min_split_len
    cpu = torch.device("cpu")  # 4 SMs on the CPU
    assert decode_min_split_len(1, 2, cpu) < decode_min_split_len(2, 2, cpu)
    assert decode_min_split_len(1, 2, cpu) == 64 and decode_min_split_len(4, 8, cpu) == 256
    assert decode_num_splits(1, 1, 16, 16, cpu) == 4  # 256 tokens: four splits of 64
    assert decode_num_splits(2, 2, 16, 16, cpu) == 1  # four kv rows: one split of 256
    case = make_paged_case([200, 9], [1, 1], 4, 1)
    torch.testing.assert_close(_run(case), exact_reference(case, SCALE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits,min_split_len", [(1, 16), (2, 16), (3, 16), (7, 16),
                                                      (4, 48), (64, 16), (2, 1000)])
def test_per_sequence_splits_match_reference(num_splits: int, min_split_len: int) -> None:
    """Each sequence divides its own context into num_splits pieces of whole tiles (at least
    min_split_len): short and long sequences, one shorter than a tile, an empty padding row,
    a table much wider than any sequence."""
    case = make_paged_case([1, 13, 40, 97, 150], [1] * 5, 4, 2, extra_width=6)
    seq_lens = case.seq_lens.clone()
    seq_lens[2] = 0
    out = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_table, seq_lens,
                                 SCALE, num_splits=num_splits, min_split_len=min_split_len,
                                 block_n=16)
    ref = exact_reference(case, SCALE)
    keep = torch.tensor([0, 1, 3, 4])
    torch.testing.assert_close(out[keep], ref[keep], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_split_arguments_are_checked() -> None:
    case = make_paged_case([20], [1], 4, 2)
    with pytest.raises(ValueError, match="split_len fixes"):
        _run(case, split_len=16, num_splits=2)
    with pytest.raises(ValueError, match="multiple of block_n"):
        _run(case, split_len=24, block_n=16)
    with pytest.raises(ValueError, match="num_splits"):
        _run(case, num_splits=0)
    with pytest.raises(ValueError, match="min_split_len"):
        _run(case, min_split_len=0)


def test_decode_rejects_bad_gqa_ratio() -> None:
    case = make_paged_case([4], [1], 3, 2)
    with pytest.raises(ValueError, match="multiple"):
        _run(case)


def test_precompile_covers_every_merge_variant(monkeypatch) -> None:
    """precompile() launches one decode per power-of-two split count up to the maximum, so no
    BLOCK_S variant is left to compile while serving."""
    import peregrine.kernels.decode_attention as da
    seen = []
    real = da.paged_decode_attention

    def spy(q, k_cache, v_cache, block_table, seq_lens, scale, **kw):
        seen.append(math.ceil(block_table.shape[1] * k_cache.shape[1] / kw["split_len"]))
        return real(q, k_cache, v_cache, block_table, seq_lens, scale, **kw)

    monkeypatch.setattr(da, "paged_decode_attention", spy)
    da.precompile(4, 2, 16, 16, torch.float32, torch.device("cpu"))
    want, s = [], 1
    while s <= da._MAX_SPLITS:
        want.append(s)
        s *= 2
    assert seen == want


@pytest.mark.parametrize("max_context,want", [(16, [1]), (64, [1]), (128, [1, 2]),
                                               (512, [1, 2, 4, 8]),
                                               (1024, [1, 2, 4, 8, 16]),
                                               (8192, [1, 2, 4, 8, 16, 32, 64])])
def test_precompile_skips_the_merge_variants_a_shorter_context_cannot_reach(
        monkeypatch, max_context: int, want: list[int]) -> None:
    """With max_context, precompile() compiles the split counts up to the next power of two of
    the most splits decode_num_splits gives such a table, at any batch size and block width."""
    import peregrine.kernels.decode_attention as da
    seen: list[int] = []
    monkeypatch.setattr(da, "paged_decode_attention",
                        lambda q, k, v, table, lens, scale, **kw:
                        seen.append(math.ceil(table.shape[1] * k.shape[1] / kw["split_len"])))
    da.precompile(4, 2, 16, 16, torch.float32, torch.device("cpu"), max_context=max_context)
    assert seen == want
    cpu = torch.device("cpu")
    reached = {da.next_pow2(da.decode_num_splits(batch, kv_heads, blocks, 16, cpu))
               for batch in (1, 3, 64) for kv_heads in (1, 8)
               for blocks in range(1, max_context // 16 + 1)}
    assert reached <= set(want)


@pytest.mark.parametrize("window", [1, 7, 64, 300])
@pytest.mark.parametrize("split_len", [16, 64])
def test_decode_sliding_window_matches_reference(window: int, split_len: int) -> None:
    """Splits wholly before the window contribute nothing (and no NaN) to the merge."""
    from kernel_cases import exact_reference
    case = make_paged_case([1, 20, 100, 70], [1, 1, 1, 1], 4, 2)
    out = _run(case, window=window, split_len=split_len)
    torch.testing.assert_close(out, exact_reference(case, SCALE, window), atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=FP8_IDS)
def test_decode_fp8_cache_equals_reference_on_dequantized_cache(cache_dtype: torch.dtype,
                                                                q_dtype: torch.dtype) -> None:
    case = make_paged_case([1, 30, 71, 200], [1, 1, 1, 1], 4, 2, dtype=q_dtype)
    quant, deq = fp8_case(case, cache_dtype)
    out = _run(quant, split_len=32, k_scale=K_SCALE, v_scale=V_SCALE)
    assert out.dtype == q_dtype
    torch.testing.assert_close(out.float(), exact_reference(deq, SCALE), **TOLERANCES[q_dtype])
    # Close to attention on the unrounded cache, within the FP8 rounding's stated bound.
    max_err, mean_err = fp8_error_bounds(cache_dtype, case.v_cache)
    err = (out.float() - exact_reference(case, SCALE)).abs()
    assert err.max().item() <= max_err and err.mean().item() <= mean_err, (err.max(), err.mean())


def test_decode_fp8_scales_fold_into_scores_and_output() -> None:
    """Scales 1.0 on the same FP8 bits are a different (rescaled) attention: both scales act."""
    case = make_paged_case([40, 9], [1, 1], 4, 1)
    quant, deq = fp8_case(case, torch.float8_e4m3fn, 2.5, 0.3)
    scaled = _run(quant, split_len=16, k_scale=2.5, v_scale=0.3)
    torch.testing.assert_close(scaled, exact_reference(deq, SCALE), atol=1e-5, rtol=1e-5)
    plain = _run(quant, split_len=16)
    raw = quant._replace(k_cache=quant.k_cache.float(), v_cache=quant.v_cache.float())
    torch.testing.assert_close(plain, exact_reference(raw, SCALE), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain, scaled, atol=1e-2)


# (variant, prefetch, clamp_tokens, aligned)
OPTION_SETS = ((False, False, False), (False, True, True), (True, True, True),
               (True, False, True))
ANY_CACHE_VARIANTS = [v for v in VARIANTS if v not in FP8_ONLY_VARIANTS]
VARIANT_CASES = [(v, *opts) for v in ANY_CACHE_VARIANTS for opts in OPTION_SETS]
VARIANT_IDS = [f"{v}{'-prefetch' if pf else ''}{'-clamp' if ct else ''}{'-aligned' if al else ''}"
               for v, pf, ct, al in VARIANT_CASES]


@pytest.mark.slow  # ~5 s each under the interpreter
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, *FP8_DTYPES], ids=["bf16", *FP8_IDS])
@pytest.mark.parametrize("variant,prefetch,clamp,aligned", VARIANT_CASES, ids=VARIANT_IDS)
def test_every_variant_matches_reference_for_every_group(variant: str, prefetch: bool,
                                                         clamp: bool, aligned: bool,
                                                         cache_dtype: torch.dtype) -> None:
    """GQA groups 1, 2, 4, 8 (one with a sliding window each other time), several splits with
    partial tiles, bf16 queries; FP8 caches with K/V scales, against the dequantized cache."""
    for group, window in ((1, None), (2, 7), (4, None), (8, 40)):
        case = make_paged_case([1, 30, 71], [1, 1, 1], 2 * group, 2, head_dim=32,
                               dtype=torch.bfloat16, seed=group)
        kw = dict(split_len=32, window=window, variant=variant, prefetch=prefetch,
                  clamp_tokens=clamp, aligned=aligned)
        if cache_dtype == torch.bfloat16:
            quant = deq = case
        else:
            quant, deq = fp8_case(case, cache_dtype)
            kw.update(k_scale=K_SCALE, v_scale=V_SCALE)
        out = _run(quant, **kw)
        torch.testing.assert_close(out.float(), exact_reference(deq, SCALE, window),
                                   **TOLERANCES[torch.bfloat16], msg=f"group {group}")


@pytest.mark.parametrize("variant,prefetch,clamp,aligned", VARIANT_CASES, ids=VARIANT_IDS)
def test_every_variant_is_exact_in_fp32_with_empty_and_windowed_splits(
        variant: str, prefetch: bool, clamp: bool, aligned: bool) -> None:
    """fp32 leaves no rounding to hide behind: a padding sequence gives zeros, splits wholly
    before the window contribute nothing, windows start mid-tile, a group of 3 pads to 4 rows;
    table entries past a sequence point outside the cache. With clamped tokens a head dim of
    40 (padded to 64 columns) keeps the column mask."""
    head_dim = 40 if clamp else 32
    case = make_paged_case([20, 1, 100], [1, 1, 1], 6, 2, head_dim=head_dim)
    seq_lens = case.seq_lens.clone()
    seq_lens[1] = 0
    case = case._replace(seq_lens=seq_lens)
    out = _run(case, split_len=32, window=30, variant=variant, prefetch=prefetch,
               clamp_tokens=clamp, aligned=aligned)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[[0, 2]], exact_reference(case, SCALE, 30)[[0, 2]],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ANY_CACHE_VARIANTS)
def test_aligned_tiles_smaller_than_a_block(variant: str) -> None:
    """Aligned tiles of 16 tokens in blocks of 32 (the tile's slot offset moves every tile),
    clamped at the last block, with a window starting mid-tile."""
    case = make_paged_case([45, 100], [1, 1], 4, 2, head_dim=32, block_size=32)
    for window in (None, 37):
        out = _run(case, split_len=64, block_n=16, window=window, variant=variant,
                   aligned=True, clamp_tokens=True)
        torch.testing.assert_close(out, exact_reference(case, SCALE, window), atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("variant", ANY_CACHE_VARIANTS)
@pytest.mark.parametrize("clamp,aligned,block_size", [(True, True, 16), (False, True, 8),
                                                      (True, True, 32), (False, False, 16)],
                         ids=["clamp-aligned-b16", "aligned-b8", "clamp-aligned-b32", "plain"])
def test_step_inputs_read_early_match_reference(variant: str, clamp: bool, aligned: bool,
                                                block_size: int) -> None:
    """early_inputs (the lengths and the first tile's block ids read first, then each tile's
    block ids a tile ahead): splits of several 16-token tiles, the last tile of a split partial
    or past the sequence, tiles inside one block and spanning several, a padding sequence, a
    window starting mid-tile; exact in fp32."""
    case = make_paged_case([70, 1, 100, 17], [1, 1, 1, 1], 6, 2, head_dim=32,
                           block_size=block_size, seed=3)
    seq_lens = case.seq_lens.clone()
    seq_lens[1] = 0
    case = case._replace(seq_lens=seq_lens)
    # "fma" also reads both kv heads in one program (only the lengths move then)
    per_program = (1, 2) if variant == "fma" else (1,)
    for window, heads in ((w, h) for w in (None, 45) for h in per_program):
        out = _run(case, split_len=48, block_n=16, window=window, variant=variant,
                   prefetch=False, clamp_tokens=clamp, aligned=aligned, early_inputs=True,
                   kv_heads_per_program=heads)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        keep = [0, 2, 3]
        torch.testing.assert_close(out[keep], exact_reference(case, SCALE, window)[keep],
                                   atol=1e-5, rtol=1e-5, msg=f"window {window}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_reads_an_fp8_cache_with_scales(variant: str) -> None:
    """The fast tier's FP8 check of each variant (group 2, e4m3, options on for some); the
    inline-PTX conversion is asked for and, under the interpreter, left out."""
    case = make_paged_case([9, 40], [1, 1], 4, 2, head_dim=32, dtype=torch.bfloat16)
    quant, deq = fp8_case(case, torch.float8_e4m3fn)
    if variant in GPU_ONLY_VARIANTS:  # refused by name here; the GPU tests check it
        with pytest.raises(ValueError, match=f"{variant}.*CUDA GPU"):
            _run(quant, split_len=32, variant=variant)
        return
    out = _run(quant, split_len=32, variant=variant, prefetch=variant != "dot_kt",
               clamp_tokens=variant != "dot", aligned=variant != "fma", asm_cvt=True,
               k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out.float(), exact_reference(deq, SCALE),
                               **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("variant", ANY_CACHE_VARIANTS)
def test_heads_first_grid_matches_reference(variant: str) -> None:
    """The (Hkv, B, S) grid: every program still finds its own sequence and kv head (uneven
    lengths, a padding sequence, several splits, GQA 3:1)."""
    case = make_paged_case([20, 1, 70, 33], [1, 1, 1, 1], 6, 2, head_dim=32)
    seq_lens = case.seq_lens.clone()
    seq_lens[1] = 0
    case = case._replace(seq_lens=seq_lens)
    out = _run(case, split_len=32, variant=variant, heads_first=True, aligned=True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[[0, 2, 3]], exact_reference(case, SCALE)[[0, 2, 3]],
                               atol=1e-5, rtol=1e-5)


FP8_WORD_CASES = [  # (prefetch, clamp_tokens, aligned, heads_first, block_n, head_dim)
    (False, False, False, False, 16, 32), (True, True, False, False, 32, 32),
    (True, False, True, True, 16, 40), (False, True, True, False, 32, 64),
    (True, True, True, False, 16, 32)]


@pytest.mark.parametrize("cache_dtype", FP8_E5M2_SLOW)
@pytest.mark.parametrize("prefetch,clamp,aligned,heads_first,block_n,head_dim", FP8_WORD_CASES)
def test_fma_fp8_is_exact_on_the_dequantized_cache(cache_dtype: torch.dtype, prefetch: bool,
                                                   clamp: bool, aligned: bool, heads_first: bool,
                                                   block_n: int, head_dim: int) -> None:
    """fp32 queries over FP8 words: a padding sequence gives zeros, windows start mid-tile and
    skip whole splits, a group of 3 pads to 4 rows, tiles end mid-block and mid-split, a head
    dim of 40 keeps the word mask (10 of 16 words); exact against the dequantized cache."""
    case = make_paged_case([20, 1, 100, 57], [1, 1, 1, 1], 6, 2, head_dim=head_dim, seed=3)
    seq_lens = case.seq_lens.clone()
    seq_lens[1] = 0
    quant, deq = fp8_case(case._replace(seq_lens=seq_lens), cache_dtype)
    for window in (None, 30):
        out = _run(quant, split_len=32, window=window, variant="fma_fp8", prefetch=prefetch,
                   clamp_tokens=clamp, aligned=aligned, heads_first=heads_first, block_n=block_n,
                   asm_cvt=True, k_scale=K_SCALE, v_scale=V_SCALE)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out[[0, 2, 3]], exact_reference(deq, SCALE, window)[[0, 2, 3]],
                                   atol=1e-5, rtol=1e-5)


def test_fma_fp8_rows_wider_than_the_tile_still_cover_every_token() -> None:
    """Few tokens per tile against many warps: the word tile's rows are capped at the tile."""
    case = make_paged_case([45, 9], [1, 1], 2, 1, head_dim=16)
    quant, deq = fp8_case(case, torch.float8_e4m3fn)
    out = _run(quant, split_len=16, block_n=16, num_warps=8, variant="fma_fp8",
               k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out, exact_reference(deq, SCALE), atol=1e-5, rtol=1e-5)


def test_fma_fp8_refuses_what_it_cannot_read() -> None:
    """A 16-bit cache, or a head dim that does not fill whole 32-bit words."""
    case = make_paged_case([9], [1], 2, 1, head_dim=32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fma_fp8.*bfloat16"):
        _run(case, variant="fma_fp8")
    odd = make_paged_case([9], [1], 2, 1, head_dim=6)
    quant, _ = fp8_case(odd, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="head dim divisible by 4.*6"):
        _run(quant, variant="fma_fp8")


def test_decode_rejects_unknown_variant_and_bad_block_n() -> None:
    case = make_paged_case([4], [1], 4, 2)
    with pytest.raises(ValueError, match="variant 'mma'"):
        _run(case, variant="mma")
    with pytest.raises(ValueError, match="block_n"):
        _run(case, block_n=24)


def test_pick_config_depends_only_on_dtypes_and_group() -> None:
    """The launcher's choice is fixed per model, so precompile() compiles what serving runs."""
    for cache in (torch.bfloat16, torch.float8_e4m3fn):
        for group in (1, 2, 4, 8):
            cfg = pick_config(torch.bfloat16, cache, group, on_gpu=True)
            assert cfg.variant in VARIANTS and cfg.block_n >= 16
            assert cfg == pick_config(torch.bfloat16, cache, group, on_gpu=True)
    # 128-token bf16 tiles only where a program may use enough shared memory
    small = pick_config(torch.bfloat16, torch.bfloat16, 2, on_gpu=True, shared_memory=99 * 1024)
    large = pick_config(torch.bfloat16, torch.bfloat16, 2, on_gpu=True,
                        shared_memory=227 * 1024)
    assert (small.block_n, large.block_n) == (64, 128)
    assert large._replace(block_n=64) == small
    assert pick_config(torch.bfloat16, torch.float8_e4m3fn, 2, on_gpu=True,
                       shared_memory=227 * 1024) == pick_config(torch.bfloat16,
                                                                torch.float8_e4m3fn, 2, True)


def test_pick_config_gives_batches_below_the_sms_short_bf16_tiles() -> None:
    """Where a batch's kv rows are fewer than the SMs (one-tile splits), a 16-bit cache takes
    64-token tiles even where 128 would fit; FP8 caches and the CPU are unaffected."""
    kw = dict(on_gpu=True, shared_memory=227 * 1024)
    large = pick_config(torch.bfloat16, torch.bfloat16, 4, **kw)
    short = pick_config(torch.bfloat16, torch.bfloat16, 4, small_batch=True, **kw)
    assert (large.block_n, short.block_n) == (128, 64)
    assert short == large._replace(block_n=64)
    assert pick_config(torch.bfloat16, torch.bfloat16, 4, on_gpu=True, shared_memory=99 * 1024,
                       small_batch=True).block_n == 64
    for group in (1, 2, 4, 8):
        for fp8_mma in (False, True):
            assert pick_config(torch.bfloat16, torch.float8_e4m3fn, group, fp8_mma=fp8_mma,
                               small_batch=True, **kw) == pick_config(
                torch.bfloat16, torch.float8_e4m3fn, group, fp8_mma=fp8_mma, **kw)
    assert pick_config(torch.bfloat16, torch.bfloat16, 4, False, small_batch=True) \
        == pick_config(torch.bfloat16, torch.bfloat16, 4, False)


def test_pick_config_takes_the_tensor_core_fp8_kernel_only_where_it_runs(monkeypatch) -> None:
    from peregrine.kernels import decode_configs
    from peregrine.kernels.decode_attention_mma import usable
    for group in (1, 2, 4, 8):
        assert pick_config(torch.bfloat16, torch.float8_e4m3fn, group, True,
                           fp8_mma=True).variant == "mma_fp8"
        assert pick_config(torch.bfloat16, torch.float8_e4m3fn, group, True).variant != "mma_fp8"
        assert pick_config(torch.bfloat16, torch.bfloat16, group, True,
                           fp8_mma=True).variant != "mma_fp8"
    assert pick_config(torch.bfloat16, torch.float8_e4m3fn, 2, False, fp8_mma=True) \
        == pick_config(torch.bfloat16, torch.float8_e4m3fn, 2, False)
    monkeypatch.setattr(decode_configs, "FP8_MMA", False)
    assert pick_config(torch.bfloat16, torch.float8_e4m3fn, 2, True,
                       fp8_mma=True) == pick_config(torch.bfloat16, torch.float8_e4m3fn, 2, True)
    # on this machine (no CUDA) it says why not, so the launcher never picks it here
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, 2, 128, dtype=torch.float8_e4m3fn)
    assert "CUDA GPU" in usable(q, cache, 2, 16)


def _launch_recorder(real, jit_calls: list, launched: list):
    """A stand-in for a Triton kernel: records JIT launches and returns a compiled kernel that
    records direct launches (the compiled launch exists only on a GPU)."""

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args: launched.append((real.fn.__name__, grid, list(args)))

    class Fake:
        def __init__(self) -> None:
            self.fn = real.fn  # an instance attribute, as Triton's (a class one would bind)

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                jit_calls.append(real.fn.__name__)
                return Compiled()
            return run

    return Fake()


def test_a_steps_later_layers_reuse_both_decode_launches(monkeypatch) -> None:
    """With a step's `launches` dict, the first layer's call binds both kernels through Triton;
    a later layer (other caches and scales) launches the same compiled kernels with its caches
    and scales in place, and the first call's scratch buffers."""
    import peregrine.kernels.decode_attention as da
    jit_calls, launched = [], []
    monkeypatch.setattr(da, "_decode_split_kernel",
                        _launch_recorder(da._decode_split_kernel, jit_calls, launched))
    monkeypatch.setattr(da, "_decode_merge_kernel",
                        _launch_recorder(da._decode_merge_kernel, jit_calls, launched))
    monkeypatch.setattr(da, "is_gpu", lambda x: True)
    monkeypatch.setattr(da, "may_reuse_launches", lambda x: True)
    monkeypatch.setattr(da, "_reuse_launches", True)
    case = make_paged_case([40, 75, 9], [1, 1, 1], 4, 2)
    other = make_paged_case([40, 75, 9], [1, 1, 1], 4, 2, seed=1)
    out = torch.empty_like(case.q)
    launches: dict = {}

    def call(c, **kw):
        return da.paged_decode_attention(case.q, c.k_cache, c.v_cache, case.block_table,
                                         case.seq_lens, SCALE, out=out, launches=launches, **kw)

    call(case)
    assert jit_calls == ["_decode_split_kernel", "_decode_merge_kernel"] and not launched
    call(other, k_scale=0.5, v_scale=2.0)
    assert len(jit_calls) == 2 and [n for n, _, _ in launched] == ["_decode_split_kernel",
                                                                 "_decode_merge_kernel"]
    (_, _, split), (_, _, merge) = launched
    names = list(inspect.signature(da._decode_split_kernel.fn).parameters)
    assert len(split) == len(names)
    assert split[names.index("k_cache_ptr")] is other.k_cache
    assert split[names.index("v_cache_ptr")] is other.v_cache
    assert split[names.index("scale_log2")] == pytest.approx(SCALE * 0.5 * math.log2(math.e))
    merge_names = list(inspect.signature(da._decode_merge_kernel.fn).parameters)
    assert merge[merge_names.index("v_scale")] == 2.0 and merge[merge_names.index("o_ptr")] is out
    call(other, window=8)  # a sliding-window layer binds afresh
    assert len(jit_calls) == 4


def test_reused_argument_positions_name_the_caches_and_scales() -> None:
    """The positions the reused launches overwrite are the kernels' cache and scale parameters."""
    import peregrine.kernels.decode_attention as da
    import peregrine.kernels.extend_attention as ea
    split = list(inspect.signature(da._decode_split_kernel.fn).parameters)
    merge = list(inspect.signature(da._decode_merge_kernel.fn).parameters)
    extend = list(inspect.signature(ea._extend_kernel.fn).parameters)
    assert [split[i] for i in (1, 2, 7)] == ["k_cache_ptr", "v_cache_ptr", "scale_log2"]
    assert merge[6] == "v_scale"
    assert [extend[i] for i in (1, 2, 7, 8)] == ["k_cache_ptr", "v_cache_ptr", "scale_log2",
                                                 "v_scale"]


def test_a_decode_launch_that_refuses_its_arguments_falls_back_to_the_jit(monkeypatch) -> None:
    import peregrine.kernels.decode_attention as da
    jit_calls = []

    def refusing(real):
        class Compiled:
            def __getitem__(self, grid):
                def launch(*args):
                    raise TypeError("the launcher takes other arguments")
                return launch

        class Fake:
            def __init__(self) -> None:
                self.fn = real.fn

            def __getitem__(self, grid):
                return lambda *a, **k: jit_calls.append(real.fn.__name__) or Compiled()
        return Fake()

    monkeypatch.setattr(da, "_decode_split_kernel", refusing(da._decode_split_kernel))
    monkeypatch.setattr(da, "_decode_merge_kernel", refusing(da._decode_merge_kernel))
    monkeypatch.setattr(da, "is_gpu", lambda x: True)
    monkeypatch.setattr(da, "may_reuse_launches", lambda x: True)
    monkeypatch.setattr(da, "_reuse_launches", True)
    case = make_paged_case([40, 75, 9], [1, 1, 1], 4, 2)
    out, launches = torch.empty_like(case.q), {}
    for _ in range(3):
        da.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_table,
                                  case.seq_lens, SCALE, out=out, launches=launches)
    assert len(jit_calls) == 6 and not launches and not da._reuse_launches
