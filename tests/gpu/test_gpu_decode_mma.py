"""The tensor-core FP8 decode kernel (decode_attention_mma) against the fp32 reference on the
dequantized cache, over the shapes it accepts; and where it refuses (CUDA, sm_89+). Its CUDA-graph
replays are checked with every variant's in test_gpu_attention_kernels.py."""
from __future__ import annotations

import pytest
import torch

from gpu_cases import ATTN_TOL, DEV, attn_error, decode_lens, paged_inputs
from peregrine.kernels.decode_attention import paged_decode_attention
from peregrine.kernels.decode_attention_mma import usable
from peregrine.kernels.decode_configs import pick_config
from peregrine.kernels.reference import dequantize_kv_ref, quantize_kv_ref

pytestmark = pytest.mark.gpu

K_SCALE, V_SCALE = 0.021, 0.017  # not powers of two: a scale folded twice or not at all shows


def _check(hq: int, hkv: int, head_dim: int, cache_dtype: torch.dtype, *, batch: int = 12,
           ctx: int = 3000, dtype: torch.dtype = torch.bfloat16, block_size: int = 16,
           window: int | None = None, empty_row: int | None = None, **kw) -> None:
    q, kc, vc, bt, sl, _ = paged_inputs(decode_lens(batch, ctx), [1] * batch, hq, hkv, head_dim,
                                        dtype, block_size=block_size)
    if empty_row is not None:
        sl[empty_row] = 0
    kq, vq = quantize_kv_ref(kc, cache_dtype, K_SCALE), quantize_kv_ref(vc, cache_dtype, V_SCALE)
    kd, vd = dequantize_kv_ref(kq, K_SCALE), dequantize_kv_ref(vq, V_SCALE)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, kq, vq, bt, sl, scale, window=window, k_scale=K_SCALE,
                                 v_scale=V_SCALE, variant="mma_fp8", **kw)  # (B, Hq, D)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    if empty_row is not None:
        assert bool((out[empty_row] == 0).all())
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    err = attn_error(out, q, kd.to(dtype), vd.to(dtype), bt, sl, qsl, scale, window)
    assert err <= ATTN_TOL[torch.bfloat16], err


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("hq,hkv", [(16, 8), (32, 8), (64, 8), (8, 8), (14, 2)],
                         ids=["2q", "4q", "8q", "1q", "7q"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_mma_fp8_matches_reference(head_dim: int, hq: int, hkv: int,
                                   cache_dtype: torch.dtype) -> None:
    """Every head dim and group size it takes (7 q heads: rows it pads), a padding sequence."""
    _check(hq, hkv, head_dim, cache_dtype, empty_row=5)


# (next tile loaded into registers ahead, shared-memory stages)
PIPELINES = [(True, 1), (False, 1), (False, 2), (False, 3), (False, 4)]


@pytest.mark.parametrize("prefetch,stages", PIPELINES,
                         ids=[f"{'prefetch-' if p else ''}stages{s}" for p, s in PIPELINES])
@pytest.mark.parametrize("window", [None, 1, 300, 1024])
@pytest.mark.parametrize("split_len", [None, 16, 512])
def test_mma_fp8_splits_and_windows(split_len: int | None, window: int | None,
                                    prefetch: bool, stages: int) -> None:
    """One-tile splits, long ones, the launcher's own; window edges inside tiles and splits
    wholly before the window; tiles loaded ahead into registers, into shared-memory stages,
    or not at all."""
    _check(32, 8, 128, torch.float8_e4m3fn, window=window, split_len=split_len,
           prefetch=prefetch, num_stages=stages)


@pytest.mark.parametrize("ctx", [1, 15, 16, 17, 33])
def test_mma_fp8_short_contexts(ctx: int) -> None:
    """Contexts that end inside, at and just past a tile, one token included."""
    _check(16, 8, 128, torch.float8_e4m3fn, batch=5, ctx=ctx)


@pytest.mark.parametrize("stages", [1, 3])
def test_mma_fp8_fp16_query_larger_blocks_heads_first_off(stages: int) -> None:
    _check(32, 8, 128, torch.float8_e4m3fn, dtype=torch.float16, block_size=64,
           heads_first=False, num_stages=stages)


def test_mma_fp8_is_the_default_for_fp8_caches_here() -> None:
    q = torch.zeros(1, 16, 128, dtype=torch.bfloat16, device=DEV)
    cache = torch.zeros(1, 16, 8, 128, dtype=torch.float8_e4m3fn, device=DEV)
    assert usable(q, cache, 2, 16) is None
    cfg = pick_config(q.dtype, cache.dtype, 2, True, fp8_mma=True)
    assert cfg.variant == "mma_fp8"


@pytest.mark.parametrize("case", ["bf16-cache", "fp32-query", "head-dim-96", "group-16",
                                  "block-8", "block-n-32", "warps-4"])
def test_mma_fp8_refuses_what_it_cannot_run(case: str) -> None:
    hq, hkv, d, dtype, cache_dtype, bs, kw = 16, 8, 128, torch.bfloat16, torch.float8_e4m3fn, 16, {}
    if case == "bf16-cache":
        cache_dtype = torch.bfloat16
    elif case == "fp32-query":
        dtype = torch.float32
    elif case == "head-dim-96":
        d = 96
    elif case == "group-16":
        hq, hkv = 32, 2
    elif case == "block-8":
        bs = 8
    elif case == "block-n-32":
        kw = dict(block_n=32)
    else:
        kw = dict(num_warps=4)
    q, kc, vc, bt, sl, _ = paged_inputs([100], [1], hq, hkv, d, dtype, block_size=bs)
    with pytest.raises(ValueError, match="mma_fp8"):
        paged_decode_attention(q, kc.to(cache_dtype), vc.to(cache_dtype), bt, sl, 1.0,
                               variant="mma_fp8", **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("window", [None, 300])
def test_mma_fp8_one_split_writes_the_output_itself(window: int | None,
                                                    dtype: torch.dtype) -> None:
    """One split a sequence: no merge, the V scale applied and a padding row zeroed here."""
    _check(32, 8, 128, torch.float8_e4m3fn, dtype=dtype, window=window, empty_row=2,
           num_splits=1)
    _check(16, 8, 128, torch.float8_e5m2, dtype=dtype, window=window, num_splits=1)


@pytest.mark.parametrize("num_splits", [1, None])
def test_mma_fp8_launches_reused_across_layers(num_splits: int | None) -> None:
    """The second and later layers of a step launch the compiled kernels again with their own
    caches and scales (with and without the merge)."""
    batch, hq, hkv, head_dim = 12, 16, 8, 128
    q, kc, vc, bt, sl, _ = paged_inputs(decode_lens(batch, 2000), [1] * batch, hq, hkv,
                                        head_dim, torch.bfloat16)
    sl[4] = 0
    scale = head_dim ** -0.5
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    launches: dict = {}
    for layer, (ks, vs) in enumerate([(K_SCALE, V_SCALE), (0.05, 0.3), (0.013, 0.02)]):
        kcl, vcl = kc * (1 + layer), vc.flip(0)
        kq = quantize_kv_ref(kcl, torch.float8_e4m3fn, ks)
        vq = quantize_kv_ref(vcl, torch.float8_e4m3fn, vs)
        paged_decode_attention(q, kq, vq, bt, sl, scale, out=out, k_scale=ks, v_scale=vs,
                               num_splits=num_splits, launches=launches)
        assert len(launches) == 1
        assert bool((out[4] == 0).all())
        kd, vd = dequantize_kv_ref(kq, ks), dequantize_kv_ref(vq, vs)
        err = attn_error(out, q, kd.to(q.dtype), vd.to(q.dtype), bt, sl, qsl, scale)
        assert err <= ATTN_TOL[torch.bfloat16] * (1 + vd.abs().max().item()), (layer, err)


def _compiled(fn) -> int:
    return sum(len(c[0]) for c in fn.device_caches.values())


@pytest.mark.parametrize("hq,hkv", [(16, 8), (32, 8)], ids=["qwen3-0.6b", "llama-3-8b"])
def test_precompile_covers_every_decode_batch_of_an_fp8_cache(hq: int, hkv: int) -> None:
    """After precompile(), decodes of one split (the output written here) and of several (the
    merge) at any batch compile nothing more."""
    from peregrine.kernels.decode_attention import _decode_merge_kernel, precompile
    from peregrine.kernels.decode_attention_mma import decode_split_mma_kernel
    precompile(hq, hkv, 128, 16, torch.bfloat16, DEV, cache_dtype=torch.float8_e4m3fn,
               max_context=2048)
    before = _compiled(decode_split_mma_kernel), _compiled(_decode_merge_kernel)
    for batch in (1, 7, 64, 200, 256):
        q, kc, vc, bt, sl, _ = paged_inputs(decode_lens(batch, 2000), [1] * batch, hq, hkv, 128,
                                            torch.bfloat16, width=128)
        out = paged_decode_attention(q, kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn),
                                     bt, sl, 128 ** -0.5)
        assert bool(torch.isfinite(out).all())
    assert (_compiled(decode_split_mma_kernel), _compiled(_decode_merge_kernel)) == before
