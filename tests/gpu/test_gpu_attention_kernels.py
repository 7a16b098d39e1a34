"""The compiled paged-attention kernels match the fp32 reference at real model shapes (CUDA)."""
from __future__ import annotations

import pytest
import torch

from gpu_cases import ATTN_TOL, DEV, DTYPE_IDS, attn_error, decode_lens, paged_inputs
from peregrine.kernels.decode_attention import (FP8_ONLY_VARIANTS, VARIANTS,
                                                paged_decode_attention)
from peregrine.kernels.extend_attention import extend_attention

pytestmark = pytest.mark.gpu

HEADS = [(32, 8), (16, 8), (32, 1)]  # (q heads, kv heads): GQA 4:1, 2:1 and MQA
# dtype x head_dim x heads, plus fp32 (3-pass tf32 dots: near-exact) at the Llama-8B shape.
MATRIX = [(dtype, d, hq, hkv) for dtype in (torch.bfloat16, torch.float16) for d in (64, 128)
          for hq, hkv in HEADS] + [(torch.float32, 128, 32, 8)]
MATRIX_IDS = [f"{DTYPE_IDS[t]}-D{d}-{hq}q{hkv}kv" for t, d, hq, hkv in MATRIX]
MIXED_CHUNKS = [(512, 1000), (700, 0)]  # (new tokens, cached prefix): a chunk and a prefill


def _decode_error(batch: int, ctx: int, hq: int, hkv: int, head_dim: int, dtype: torch.dtype,
                  width: int | None = None, window: int | None = None) -> float:
    q, kc, vc, bt, sl, _ = paged_inputs(decode_lens(batch, ctx), [1] * batch, hq, hkv, head_dim,
                                        dtype, width=width)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, kc, vc, bt, sl, scale, window=window)  # (B, Hq, D)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    return attn_error(out, q, kc, vc, bt, sl, qsl, scale, window)


def _extend_error(chunks: list[tuple[int, int]], hq: int, hkv: int, head_dim: int,
                  dtype: torch.dtype, window: int | None = None, **tiles) -> float:
    q_lens = [n for n, _ in chunks]
    q, kc, vc, bt, sl, qsl = paged_inputs([n + p for n, p in chunks], q_lens, hq, hkv, head_dim,
                                          dtype)
    scale = head_dim ** -0.5
    out = extend_attention(q, kc, vc, bt, sl, qsl, scale, max(q_lens), window=window,
                           **tiles)  # (T, Hq, D)
    return attn_error(out, q, kc, vc, bt, sl, qsl, scale, window)


@pytest.mark.parametrize("dtype,head_dim,hq,hkv", MATRIX, ids=MATRIX_IDS)
def test_decode_matches_reference(dtype: torch.dtype, head_dim: int, hq: int, hkv: int) -> None:
    assert _decode_error(8, 2048, hq, hkv, head_dim, dtype) <= ATTN_TOL[dtype]


@pytest.mark.parametrize("dtype,head_dim,hq,hkv", MATRIX, ids=MATRIX_IDS)
def test_extend_matches_reference(dtype: torch.dtype, head_dim: int, hq: int, hkv: int) -> None:
    assert _extend_error(MIXED_CHUNKS, hq, hkv, head_dim, dtype) <= ATTN_TOL[dtype]


@pytest.mark.parametrize("window", [300, 1024])
def test_decode_sliding_window_matches_reference(window: int) -> None:
    """Window edges fall inside splits, and whole splits lie before the window."""
    err = _decode_error(8, 2048, 32, 8, 128, torch.bfloat16, window=window)
    assert err <= ATTN_TOL[torch.bfloat16]


@pytest.mark.parametrize("window", [300, 1024])
def test_extend_sliding_window_matches_reference(window: int) -> None:
    err = _extend_error(MIXED_CHUNKS, 32, 8, 128, torch.bfloat16, window=window)
    assert err <= ATTN_TOL[torch.bfloat16]


# (batch, context, q heads, kv heads, block-table width): the serving shapes of the benchmarks.
DECODE_SHAPES = [(1, 128, 32, 8, None), (64, 8192, 32, 8, None), (256, 1024, 32, 8, None),
                 (256, 8192, 32, 8, None), (256, 8192, 32, 1, None),
                 (8, 1024, 32, 8, 2048)]  # a graph-style table sized for 32k tokens


@pytest.mark.parametrize("batch,ctx,hq,hkv,width", DECODE_SHAPES,
                         ids=[f"B{b}-ctx{c}-{q}q{k}kv" + (f"-w{w}" if w else "")
                              for b, c, q, k, w in DECODE_SHAPES])
def test_decode_at_serving_shapes(batch: int, ctx: int, hq: int, hkv: int,
                                  width: int | None) -> None:
    err = _decode_error(batch, ctx, hq, hkv, 128, torch.bfloat16, width=width)
    assert err <= ATTN_TOL[torch.bfloat16]


PREFILL_SHAPES = [([(512, 0)] * 4, 128), ([(2048, 0)], 128), ([(4096, 0)], 128), ([(4096, 0)], 64),
                  ([(1024, 3072)] * 2, 128), ([(512, 7680)] * 2, 128)]


@pytest.mark.parametrize("chunks,head_dim", PREFILL_SHAPES,
                         ids=["+".join(f"{n}@{p}" for n, p in c) + f"-D{d}"
                              for c, d in PREFILL_SHAPES])
def test_extend_at_prefill_shapes(chunks: list[tuple[int, int]], head_dim: int) -> None:
    assert _extend_error(chunks, 32, 8, head_dim, torch.bfloat16) <= ATTN_TOL[torch.bfloat16]


TILES = [(64, 64, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8), (64, 32, 4)]


@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("tiles", TILES, ids=["x".join(map(str, t)) for t in TILES])
def test_extend_tile_variants_match_reference(tiles: tuple[int, int, int], head_dim: int) -> None:
    """Every prefill tile choice (BLOCK_M x BLOCK_N x warps) of the tile sweep gives the answer."""
    from triton.runtime.errors import OutOfResources
    block_m, block_n, warps = tiles
    try:
        err = _extend_error([(4096, 0)], 32, 8, head_dim, torch.bfloat16, block_m=block_m,
                            block_n=block_n, num_warps=warps)
    except OutOfResources as e:  # NOTE: a tile too big for this GPU's shared memory is no bug
        pytest.skip(f"tiles {tiles} do not fit this GPU: {e}")
    assert err <= ATTN_TOL[torch.bfloat16]


def test_decode_cuda_graph_replays_with_new_lengths_and_tables() -> None:
    """Capture decode once, then change seq_lens / block_table contents and replay."""
    batch, hq, hkv, head_dim, width = 8, 32, 8, 128, 256
    q, kc, vc, bt, sl, _ = paged_inputs([width * 16] * batch, [1] * batch, hq, hkv, head_dim,
                                        torch.bfloat16, width=width)
    scale = head_dim ** -0.5
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    paged_decode_attention(q, kc, vc, bt, sl, scale, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kc, vc, bt, sl, scale, out=out)
    for _ in range(3):
        # NOTE: lengths include 0 (a padding slot of a graph batch): its row must come out zero.
        sl.copy_(torch.randint(0, width * 16 + 1, (batch,), device=DEV, dtype=torch.int32))
        bt.copy_(bt[torch.randperm(batch, device=DEV)])
        q.normal_()
        graph.replay()
        assert attn_error(out, q, kc, vc, bt, sl, qsl, scale) <= ATTN_TOL[torch.bfloat16]


def test_decode_gives_zeros_for_an_empty_sequence() -> None:
    q, kc, vc, bt, sl, _ = paged_inputs([300, 40, 17], [1, 1, 1], 32, 8, 128, torch.bfloat16)
    sl[1] = 0  # a CUDA-graph padding slot: no context at all
    out = paged_decode_attention(q, kc, vc, bt, sl, 128 ** -0.5)  # (B, Hq, D)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    qsl = torch.arange(4, dtype=torch.int32, device=DEV)
    assert attn_error(out, q, kc, vc, bt, sl, qsl, 128 ** -0.5) <= ATTN_TOL[torch.bfloat16]


def test_decode_writes_into_a_strided_out_view() -> None:
    q, kc, vc, bt, sl, _ = paged_inputs([100, 33], [1, 1], 32, 8, 128, torch.bfloat16)
    full = torch.full((4, 32, 128), 7.0, device=DEV, dtype=torch.bfloat16)  # (4, Hq, D)
    paged_decode_attention(q, kc, vc, bt, sl, 128 ** -0.5, out=full[1:3])
    qsl = torch.arange(3, dtype=torch.int32, device=DEV)
    assert attn_error(full[1:3], q, kc, vc, bt, sl, qsl, 128 ** -0.5) <= ATTN_TOL[torch.bfloat16]
    assert bool((full[0] == 7.0).all()) and bool((full[3] == 7.0).all())


def test_extend_leaves_the_rows_before_seq_start_untouched() -> None:
    """The first two sequences are decodes run by the decode kernel: their rows stay as they are."""
    q, kc, vc, bt, sl, qsl = paged_inputs([80, 3, 600], [1, 1, 300], 32, 8, 128, torch.bfloat16)
    out = torch.full_like(q, 7.0)  # (T, Hq, D)
    extend_attention(q, kc, vc, bt, sl, qsl, 128 ** -0.5, 300, out=out, seq_start=2)
    assert bool((out[:2] == 7.0).all())
    exact = attn_error(out[2:], q[2:], kc, vc, bt[2:], sl[2:], qsl[2:] - 2, 128 ** -0.5)
    assert exact <= ATTN_TOL[torch.bfloat16]


# --- FP8 KV cache ---------------------------------------------------------------------------
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
# Qwen3-0.6B (16 q / 8 kv heads) and Llama-3-8B (32 / 8), head dim 128.
FP8_HEADS = [(16, 8), (32, 8)]
# Not powers of two (a wrong fold shows); randn K/V stay inside e4m3's 448 after dividing.
K_SCALE, V_SCALE = 0.021, 0.017


def _fp8(kc: torch.Tensor, vc: torch.Tensor, cache_dtype: torch.dtype):
    """(FP8 caches holding k / K_SCALE, v / V_SCALE; their fp32 dequantized values)."""
    from peregrine.kernels.reference import dequantize_kv_ref, quantize_kv_ref
    kq, vq = quantize_kv_ref(kc, cache_dtype, K_SCALE), quantize_kv_ref(vc, cache_dtype, V_SCALE)
    return kq, vq, dequantize_kv_ref(kq, K_SCALE), dequantize_kv_ref(vq, V_SCALE)


def _fp8_bound(cache_dtype: torch.dtype, v_cache: torch.Tensor) -> float:
    """Max error an FP8 cache may add to attention: half an ulp of the largest |v| (the output
    is a convex combination of V rows; K's rounding moves the weights a little more)."""
    half_ulp = 2.0 ** -(4 if cache_dtype == torch.float8_e4m3fn else 3)
    return half_ulp * v_cache.float().abs().max().item()


@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("hq,hkv", FP8_HEADS, ids=["qwen3-0.6b", "llama-3-8b"])
def test_decode_fp8_cache_matches_reference_on_the_dequantized_cache(
        hq: int, hkv: int, cache_dtype: torch.dtype) -> None:
    batch, ctx = 16, 4096
    q, kc, vc, bt, sl, _ = paged_inputs(decode_lens(batch, ctx), [1] * batch, hq, hkv, 128,
                                        torch.bfloat16)
    kq, vq, kd, vd = _fp8(kc, vc, cache_dtype)
    scale = 128 ** -0.5
    out = paged_decode_attention(q, kq, vq, bt, sl, scale, k_scale=K_SCALE,
                                 v_scale=V_SCALE)  # (B, Hq, D)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    assert attn_error(out, q, kd, vd, bt, sl, qsl, scale) <= ATTN_TOL[torch.bfloat16]
    assert attn_error(out, q, kc, vc, bt, sl, qsl, scale) <= _fp8_bound(cache_dtype, vc)


@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("hq,hkv", FP8_HEADS, ids=["qwen3-0.6b", "llama-3-8b"])
def test_extend_fp8_cache_matches_reference_on_the_dequantized_cache(
        hq: int, hkv: int, cache_dtype: torch.dtype) -> None:
    chunks = [(512, 3000), (700, 0), (1, 2047)]  # (new tokens, cached prefix)
    q_lens = [n for n, _ in chunks]
    q, kc, vc, bt, sl, qsl = paged_inputs([n + p for n, p in chunks], q_lens, hq, hkv, 128,
                                          torch.bfloat16)
    kq, vq, kd, vd = _fp8(kc, vc, cache_dtype)
    scale = 128 ** -0.5
    for window in (None, 1024):
        out = extend_attention(q, kq, vq, bt, sl, qsl, scale, max(q_lens), window=window,
                               k_scale=K_SCALE, v_scale=V_SCALE)  # (T, Hq, D)
        assert attn_error(out, q, kd, vd, bt, sl, qsl, scale, window) <= ATTN_TOL[torch.bfloat16]
    assert attn_error(out, q, kc, vc, bt, sl, qsl, scale, 1024) <= _fp8_bound(cache_dtype, vc)


@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_store_kv_fp8_is_bit_exact_with_torch(src_dtype: torch.dtype,
                                              cache_dtype: torch.dtype) -> None:
    """The hardware's saturating conversion against torch's: every FP8 value, every tie between
    neighbours (to even) and either side of it, subnormals, saturation, signed zeros."""
    from peregrine.kernels.reference import store_kv_ref
    from peregrine.kernels.store_kv import store_kv
    finite = torch.arange(256, dtype=torch.uint8, device=DEV).view(cache_dtype).float()
    finite = finite[torch.isfinite(finite)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    x = torch.cat([finite, mids, torch.nextafter(mids, finite[1:]),
                   torch.nextafter(mids, finite[:-1]), torch.randn(20000, device=DEV) * 300,
                   torch.tensor([1e30, -1e30, 0.0, -0.0], device=DEV)])
    x = torch.cat([x, torch.zeros((-x.numel()) % 1024, device=DEV)]).view(-1, 8, 128)
    x = x.to(src_dtype)  # (T, Hkv, D)
    tokens = x.shape[0]
    kc = torch.zeros(tokens // 16 + 2, 16, 8, 128, dtype=cache_dtype, device=DEV)
    vc, kr, vr = kc.clone(), kc.clone(), kc.clone()
    slots = torch.randperm(kc.shape[0] * 16, device=DEV)[:tokens]
    slots[::5] = -1
    for k_scale, v_scale in ((1.0, 1.0), (K_SCALE, 3.0)):
        store_kv(x, x.flip(0), kc, vc, slots, k_scale, v_scale)
        store_kv_ref(x, x.flip(0), kr, vr, slots, k_scale, v_scale)
        assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8))
        assert torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))


def test_decode_fp8_cuda_graph_replays_with_scales() -> None:
    """The scales are plain float arguments: captured once, the same every replay."""
    batch, hq, hkv, head_dim, width = 8, 16, 8, 128, 256
    q, kc, vc, bt, sl, _ = paged_inputs([width * 16] * batch, [1] * batch, hq, hkv, head_dim,
                                        torch.bfloat16, width=width)
    kq, vq, kd, vd = _fp8(kc, vc, torch.float8_e4m3fn)
    scale = head_dim ** -0.5
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    kw = dict(out=out, k_scale=K_SCALE, v_scale=V_SCALE)
    paged_decode_attention(q, kq, vq, bt, sl, scale, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kq, vq, bt, sl, scale, **kw)
    for _ in range(3):
        sl.copy_(torch.randint(0, width * 16 + 1, (batch,), device=DEV, dtype=torch.int32))
        bt.copy_(bt[torch.randperm(batch, device=DEV)])
        q.normal_()
        graph.replay()
        assert attn_error(out, q, kd, vd, bt, sl, qsl, scale) <= ATTN_TOL[torch.bfloat16]


# --- split-kernel variants (decode_attention.VARIANTS) -----------------------------------------
# (prefetch, clamp_tokens, aligned, asm_cvt) per variant: each as compiled for the GPU,
# whatever pick_config chooses.
OPTION_SETS = ((False, False, False, False), (False, False, True, True), (False, True, True, True),
               (True, True, True, True), (True, True, False, False))
VARIANT_CASES = [(v, *opts) for v in VARIANTS for opts in OPTION_SETS]
_OPTION_NAMES = ("prefetch", "clamp", "aligned", "asm")
VARIANT_IDS = ["-".join([v] + [n for n, on in zip(_OPTION_NAMES, o) if on])
               for v, *o in VARIANT_CASES]
TILE = {"mma_fp8": 16}  # tokens a tile where a variant reads one size only (else 32)


@pytest.mark.parametrize("variant,prefetch,clamp,aligned,asm", VARIANT_CASES, ids=VARIANT_IDS)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, *FP8], ids=["bf16", *FP8_IDS])
def test_decode_variant_matches_reference(variant: str, prefetch: bool, clamp: bool,
                                          aligned: bool, asm: bool,
                                          cache_dtype: torch.dtype) -> None:
    """Every variant at Qwen3-0.6B's heads and at Llama-3-8B's with a sliding window, bf16
    queries, several tiles and splits; FP8 against the dequantized cache (variants that read
    FP8 caches only must refuse a bf16 one)."""
    if variant in FP8_ONLY_VARIANTS and cache_dtype == torch.bfloat16:
        q, kc, vc, bt, sl, _ = paged_inputs([100], [1], 16, 8, 128, torch.bfloat16)
        with pytest.raises(ValueError, match=variant):
            paged_decode_attention(q, kc, vc, bt, sl, 1.0, variant=variant)
        return
    _check_decode_heads(cache_dtype, dict(variant=variant, prefetch=prefetch, clamp_tokens=clamp,
                                          aligned=aligned, asm_cvt=asm,
                                          block_n=TILE.get(variant, 32), split_len=512))


def _check_decode_heads(cache_dtype: torch.dtype, kw: dict, empty_row: int | None = None) -> None:
    """paged_decode_attention(**kw) against the reference at Qwen3-0.6B's heads and at
    Llama-3-8B's with a sliding window, 12 sequences up to 3,000 tokens (row empty_row of
    length 0, whose output must be zeros); FP8 caches against their dequantized values."""
    batch, ctx = 12, 3000
    for (hq, hkv), window in zip(FP8_HEADS, (None, 700)):
        q, kc, vc, bt, sl, _ = paged_inputs(decode_lens(batch, ctx), [1] * batch, hq, hkv, 128,
                                            torch.bfloat16)
        if empty_row is not None:
            sl[empty_row] = 0
        kd, vd, scales = kc, vc, {}
        if cache_dtype != torch.bfloat16:
            kc, vc, kd, vd = _fp8(kc, vc, cache_dtype)
            scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
        scale = 128 ** -0.5
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        out = paged_decode_attention(q, kc, vc, bt, sl, scale, window=window, **kw,
                                     **scales)  # (B, Hq, D)
        if empty_row is not None:
            assert bool((out[empty_row] == 0).all())
        err = attn_error(out, q, kd, vd, bt, sl, qsl, scale, window)
        assert err <= ATTN_TOL[torch.bfloat16], (hq, window, err)


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_variant_cuda_graph_replays_with_new_lengths(variant: str) -> None:
    """Captured once with every option on, replayed over new lengths (0 included), block tables
    and queries."""
    batch, hq, hkv, head_dim, width = 8, 16, 8, 128, 128
    q, kc, vc, bt, sl, _ = paged_inputs([width * 16] * batch, [1] * batch, hq, hkv, head_dim,
                                        torch.bfloat16, width=width)
    kq, vq, kd, vd = _fp8(kc, vc, torch.float8_e4m3fn)
    scale = head_dim ** -0.5
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    kw = dict(out=out, k_scale=K_SCALE, v_scale=V_SCALE, variant=variant, prefetch=True,
              clamp_tokens=True, aligned=True, asm_cvt=True, heads_first=True)
    paged_decode_attention(q, kq, vq, bt, sl, scale, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kq, vq, bt, sl, scale, **kw)
    for _ in range(3):
        sl.copy_(torch.randint(0, width * 16 + 1, (batch,), device=DEV, dtype=torch.int32))
        sl[0] = 0
        bt.copy_(bt[torch.randperm(batch, device=DEV)])
        q.normal_()
        graph.replay()
        assert bool((out[0] == 0).all())
        assert attn_error(out, q, kd, vd, bt, sl, qsl, scale) <= ATTN_TOL[torch.bfloat16]


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_heads_first_grid_matches_reference(variant: str) -> None:
    """The (Hkv, B, S) grid at Qwen3-0.6B's and Llama-3-8B's heads with an FP8 cache."""
    batch, ctx = 12, 3000
    for hq, hkv in FP8_HEADS:
        q, kc, vc, bt, sl, _ = paged_inputs(decode_lens(batch, ctx), [1] * batch, hq, hkv, 128,
                                            torch.bfloat16)
        kq, vq, kd, vd = _fp8(kc, vc, torch.float8_e4m3fn)
        scale = 128 ** -0.5
        out = paged_decode_attention(q, kq, vq, bt, sl, scale, k_scale=K_SCALE, v_scale=V_SCALE,
                                     variant=variant, heads_first=True, split_len=512,
                                     block_n=TILE.get(variant, 32))  # (B, Hq, D)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        assert attn_error(out, q, kd, vd, bt, sl, qsl, scale) <= ATTN_TOL[torch.bfloat16]


# (kv heads per program, warps, prefetch, clamp_tokens, aligned, heads_first) of the "fma"
# variant over adjacent kv heads, at the warps that keep its tile in registers
KV_HEADS_CASES = [(2, 4, False, False, False, False), (2, 2, True, True, True, True),
                  (4, 8, False, True, True, False), (4, 4, True, False, False, True)]


@pytest.mark.parametrize("per_program,warps,prefetch,clamp,aligned,heads_first", KV_HEADS_CASES,
                         ids=[f"x{c[0]}-w{c[1]}" for c in KV_HEADS_CASES])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, *FP8], ids=["bf16", *FP8_IDS])
def test_decode_kv_heads_per_program_matches_reference(per_program: int, warps: int,
                                                       prefetch: bool, clamp: bool,
                                                       aligned: bool, heads_first: bool,
                                                       cache_dtype: torch.dtype) -> None:
    """Several adjacent kv heads a program ("fma") at Qwen3-0.6B's heads and at Llama-3-8B's
    with a sliding window, the launcher's split length, a padding sequence; FP8 against the
    dequantized cache."""
    _check_decode_heads(cache_dtype, dict(variant="fma", kv_heads_per_program=per_program,
                                          num_warps=warps, prefetch=prefetch, clamp_tokens=clamp,
                                          aligned=aligned, heads_first=heads_first, block_n=16),
                        empty_row=3)
