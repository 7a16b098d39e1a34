"""The compiled paged-attention kernels match the fp32 reference at real model shapes (CUDA)."""
from __future__ import annotations

import pytest
import torch

from gpu_cases import ATTN_TOL, DEV, DTYPE_IDS, attn_error, decode_lens, paged_inputs
from peregrine.kernels.decode_attention import paged_decode_attention
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
