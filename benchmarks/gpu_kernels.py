"""Time every Triton kernel at real shapes on one GPU: latency and achieved bandwidth / FLOP/s.

Usage (H200): python benchmarks/gpu_kernels.py [--budget-s 170] [--fp8-only]
--fp8-only: just the FP8 KV cache cases: decode at W1's shape (1,000 Qwen3-0.6B sequences of
~1,000 tokens) with a bf16 vs an FP8 cache, a tile sweep of the FP8 decode, FP8 store_kv.
Prints each case's latency (triton.testing.do_bench, L2 flushed), the achieved GB/s of K/V (and of
all other tensors for the elementwise kernels) against the 4.2 TB/s HBM peak, and the max error
against the torch reference; writes $OUT/gpu_kernels.json when OUT is set, and exits 1 if an
error is over the tolerance. The correctness tests proper: python -m pytest -m gpu tests/gpu
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peregrine.kernels import reference as ref  # noqa: E402
from peregrine.kernels.activation import silu_and_mul  # noqa: E402
from peregrine.kernels.decode_attention import paged_decode_attention  # noqa: E402
from peregrine.kernels.extend_attention import extend_attention  # noqa: E402
from peregrine.kernels.rmsnorm import rms_norm  # noqa: E402
from peregrine.kernels.rotary import apply_rope  # noqa: E402
from peregrine.kernels.store_kv import store_kv  # noqa: E402

PEAK_GBS = 4200.0  # H200 HBM3e
PEAK_TFLOPS = 989.0  # H200 dense bf16/fp16 tensor cores
# Max abs error vs the fp32 reference on the same (rounded) inputs; outputs are O(1).
TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}
ELEM_TOL = 2 ** -6  # elementwise kernels: 2 bf16 ulps (rel_err), both sides round once from fp32
DEV = torch.device("cuda")
RESULTS: list[dict] = []
FAILED: list[str] = []


def record(kind: str, cfg: dict, err: float | None, tol: float | None, ms: float | None,
           nbytes: float, flops: float = 0.0) -> None:
    row = dict(kernel=kind, **cfg, max_err=err, tol=tol, ok=err is None or err <= tol)
    if ms is not None:
        row.update(us=ms * 1e3, gbs=nbytes / ms / 1e6, pct_hbm=100 * nbytes / ms / 1e6 / PEAK_GBS)
        if flops:
            row.update(tflops=flops / ms / 1e9, pct_tc=100 * flops / ms / 1e9 / PEAK_TFLOPS)
    RESULTS.append(row)
    if not row["ok"]:
        FAILED.append(f"{kind} {cfg} err={err:.3g} > {tol}")
    cfg_s = " ".join(f"{k}={v}" for k, v in cfg.items())
    err_s = "" if err is None else f"err={err:.2e}{'' if row['ok'] else ' FAIL'}"
    time_s = "" if ms is None else (f"{row['us']:9.1f} us {row['gbs']:7.0f} GB/s "
                                    f"({row['pct_hbm']:4.1f}% of 4.2 TB/s)")
    if flops and ms is not None:
        time_s += f" {row['tflops']:6.1f} TFLOP/s ({row['pct_tc']:4.1f}%)"
    print(f"{kind:8s} {cfg_s:58s} {err_s:16s} {time_s}", flush=True)


def bench(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=40)


def paged_inputs(seq_lens: list[int], q_lens: list[int], hq: int, hkv: int, head_dim: int,
                 dtype: torch.dtype, block_size: int = 16, width: int | None = None):
    """Caches holding exactly the sequences' blocks (shuffled), q, block table, lens, qsl."""
    nbs = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(sum(nbs), device=DEV).to(torch.int32)
    width = width or max(nbs)
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=DEV)
    used = 0
    for i, nb in enumerate(nbs):
        block_table[i, :nb] = perm[used:used + nb]
        used += nb
    shape = (sum(nbs), block_size, hkv, head_dim)
    k_cache = torch.randn(shape, device=DEV, dtype=dtype)
    v_cache = torch.randn(shape, device=DEV, dtype=dtype)
    q = torch.randn(sum(q_lens), hq, head_dim, device=DEV, dtype=dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=DEV)
    qsl[1:] = torch.tensor(q_lens, device=DEV).cumsum(0)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return q, k_cache, v_cache, block_table, seq_lens_t, qsl


def attn_error(out, q, k_cache, v_cache, block_table, seq_lens, qsl, scale,
               window: int | None = None) -> float:
    exact = ref.paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), block_table,
                                    seq_lens, qsl, scale, window=window)
    return (out.float() - exact).abs().max().item()


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Max of |out - expected| / (|expected| + 1): relative for large values, absolute near 0."""
    return ((out.float() - expected.float()).abs() / (expected.float().abs() + 1)).max().item()


def kv_bytes(seq_lens: list[int], hkv: int, head_dim: int, dtype: torch.dtype) -> float:
    return 2.0 * sum(seq_lens) * hkv * head_dim * dtype.itemsize


# The FP8 caches hold k / K_SCALE and v / V_SCALE (randn K/V: |x| < ~7, so x / 0.02 stays within
# e4m3's 448); not powers of two, so a wrong fold of the scales shows in the error.
K_SCALE, V_SCALE = 0.021, 0.017


def to_fp8_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, cache_dtype: torch.dtype):
    """(FP8 k cache, FP8 v cache, their fp32 dequantized values): the kernel must equal the
    reference on the latter."""
    kq = ref.quantize_kv_ref(k_cache, cache_dtype, K_SCALE)
    vq = ref.quantize_kv_ref(v_cache, cache_dtype, V_SCALE)
    return kq, vq, ref.dequantize_kv_ref(kq, K_SCALE), ref.dequantize_kv_ref(vq, V_SCALE)


def run_decode(batch: int, ctx: int, hq: int, hkv: int, head_dim: int, dtype: torch.dtype,
               timed: bool, width: int | None = None, window: int | None = None,
               cache_dtype: torch.dtype | None = None, min_ctx: int | None = None,
               tiles: tuple[int, int, int] | None = None) -> None:
    """cache_dtype: an FP8 type for an FP8 cache (default: dtype); tiles: (BLOCK_N, warps,
    stages) of the split kernel; min_ctx: lengths are drawn from [min_ctx, ctx] (default ctx/2)."""
    gen = torch.Generator().manual_seed(batch * 7 + ctx)
    # NOTE: lengths spread over [ctx/2, ctx] so splits end at different places per sequence.
    low = min_ctx or max(1, ctx // 2)
    lens = [ctx] + torch.randint(low, ctx + 1, (batch - 1,), generator=gen).tolist()
    q, kc, vc, bt, sl, _ = paged_inputs(lens, [1] * batch, hq, hkv, head_dim, dtype, width=width)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    scale = head_dim ** -0.5
    kw: dict = dict(window=window)
    if tiles:
        kw.update(zip(("block_n", "num_warps", "num_stages"), tiles))
    ref_k, ref_v = kc, vc
    if cache_dtype is not None and cache_dtype != dtype:
        kc, vc, ref_k, ref_v = to_fp8_cache(kc, vc, cache_dtype)
        kw.update(k_scale=K_SCALE, v_scale=V_SCALE)
    out = paged_decode_attention(q, kc, vc, bt, sl, scale, **kw)
    # NOTE: against the exact answer on the dequantized cache: the FP8 rounding itself is the
    # cache's choice, what is checked is that the kernel computes on exactly those values.
    err = attn_error(out, q, ref_k, ref_v, bt, sl, qsl, scale, window)
    ms = bench(lambda: paged_decode_attention(q, kc, vc, bt, sl, scale, out=out,
                                              **kw)) if timed else None
    cfg = dict(dtype=str(dtype)[6:], D=head_dim, hq=hq, hkv=hkv, B=batch, ctx=ctx)
    if kc.dtype != dtype:
        cfg["cache"] = str(kc.dtype)[6:]
    if min_ctx:
        cfg["min_ctx"] = min_ctx
    if tiles:
        cfg["tiles"] = "x".join(map(str, tiles))
    if width:
        cfg["width"] = width
    if window:
        cfg["window"] = window
    record("decode", cfg, err, TOL[dtype], ms, kv_bytes(lens, hkv, head_dim, kc.dtype))


def run_extend(chunks: list[tuple[int, int]], hq: int, hkv: int, head_dim: int,
               dtype: torch.dtype, timed: bool, tiles: tuple[int, int, int] | None = None,
               window: int | None = None, cache_dtype: torch.dtype | None = None) -> None:
    """chunks: (new tokens, cached prefix) per sequence; tiles: (BLOCK_M, BLOCK_N, warps);
    cache_dtype: an FP8 type for an FP8 cache (default: dtype)."""
    tile_kw = dict(zip(("block_m", "block_n", "num_warps"), tiles or (None, None, None)))
    q_lens = [n for n, _ in chunks]
    lens = [n + p for n, p in chunks]
    q, kc, vc, bt, sl, qsl = paged_inputs(lens, q_lens, hq, hkv, head_dim, dtype)
    scale = head_dim ** -0.5
    max_q = max(q_lens)
    ref_k, ref_v = kc, vc
    if cache_dtype is not None and cache_dtype != dtype:
        kc, vc, ref_k, ref_v = to_fp8_cache(kc, vc, cache_dtype)
        tile_kw.update(k_scale=K_SCALE, v_scale=V_SCALE)
    out = extend_attention(q, kc, vc, bt, sl, qsl, scale, max_q, window=window, **tile_kw)
    err = attn_error(out, q, ref_k, ref_v, bt, sl, qsl, scale, window)
    ms = bench(lambda: extend_attention(q, kc, vc, bt, sl, qsl, scale, max_q, out=out,
                                        window=window, **tile_kw)) if timed else None
    # causal: query at position p sees p + 1 keys
    visible = sum(n * p + n * (n + 1) / 2 for n, p in chunks)
    flops = 4.0 * hq * head_dim * visible
    cfg = dict(dtype=str(dtype)[6:], D=head_dim, hq=hq, hkv=hkv,
               chunks="+".join(f"{n}@{p}" for n, p in chunks))
    if kc.dtype != dtype:
        cfg["cache"] = str(kc.dtype)[6:]
    if tiles:
        cfg["tiles"] = "x".join(map(str, tiles))
    if window:
        cfg["window"] = window  # NOTE: the FLOP count above ignores the window
    record("extend", cfg, err, TOL[dtype], ms, kv_bytes(lens, hkv, head_dim, kc.dtype), flops)


def run_elementwise(dtype: torch.dtype, tokens: int = 4096) -> None:
    hidden, inter, hq, hkv, head_dim = 4096, 14336, 32, 8, 128
    dt = str(dtype)[6:]
    x = torch.randn(tokens, hidden, device=DEV, dtype=dtype)
    res = torch.randn_like(x)
    w = torch.rand(hidden, device=DEV, dtype=dtype) + 0.5
    out, new_res = rms_norm(x, w, 1e-6, residual=res)
    out_ref, res_ref = ref.rms_norm_ref(x, w, 1e-6, residual=res)
    err = max(rel_err(out, out_ref), rel_err(new_res, res_ref))
    ms = bench(lambda: rms_norm(x, w, 1e-6, residual=res))
    record("rmsnorm", dict(dtype=dt, T=tokens, H=hidden, residual=True), err, ELEM_TOL, ms,
           4.0 * x.numel() * dtype.itemsize)

    g = torch.randn(tokens, 2 * inter, device=DEV, dtype=dtype)
    err = rel_err(silu_and_mul(g), ref.silu_and_mul_ref(g))
    ms = bench(lambda: silu_and_mul(g))
    record("silu_mul", dict(dtype=dt, T=tokens, I=inter), err, ELEM_TOL, ms,
           1.5 * g.numel() * dtype.itemsize)

    qkv = torch.randn(tokens, hq + 2 * hkv, head_dim, device=DEV, dtype=dtype)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
    pos = torch.randint(0, 8192, (tokens,), device=DEV)
    inv = 1.0 / 500000 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim)
    freqs = torch.outer(torch.arange(8192, device=DEV).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # (8192, D)
    q_ref, k_ref = ref.apply_rope_ref(q, k, pos, cache)
    apply_rope(q, k, pos, cache)
    err = max(rel_err(q, q_ref), rel_err(k, k_ref))
    ms = bench(lambda: apply_rope(q, k, pos, cache))
    record("rope", dict(dtype=dt, T=tokens, hq=hq, hkv=hkv, D=head_dim), err, ELEM_TOL, ms,
           2.0 * (q.numel() + k.numel()) * dtype.itemsize)

    slots = torch.randperm(tokens * 2, device=DEV)[:tokens]
    slots[::7] = -1
    kv = torch.randn(tokens, 2, hkv, head_dim, device=DEV, dtype=dtype)
    kc = torch.zeros(tokens * 2 // 16, 16, hkv, head_dim, device=DEV, dtype=dtype)
    vc, kc_ref, vc_ref = kc.clone(), kc.clone(), kc.clone()
    store_kv(kv[:, 0], kv[:, 1], kc, vc, slots)
    ref.store_kv_ref(kv[:, 0], kv[:, 1], kc_ref, vc_ref, slots)
    err = max((kc - kc_ref).abs().max().item(), (vc - vc_ref).abs().max().item())
    ms = bench(lambda: store_kv(kv[:, 0], kv[:, 1], kc, vc, slots))
    record("store_kv", dict(dtype=dt, T=tokens, hkv=hkv, D=head_dim), err, 0.0, ms,
           2.0 * kv.numel() * dtype.itemsize)


def run_fp8(t0: float, budget_s: float) -> None:
    """The FP8 KV cache: W1's decode (Qwen3-0.6B: 16 q / 8 kv heads, D=128; 1,000 sequences of
    ~1,000 tokens) with a bf16 cache, then FP8 caches (default tiles, then a small sweep), the
    Llama-8B layout, and FP8 store_kv (bit-exact against the torch reference)."""
    w1 = dict(batch=1000, ctx=1100, min_ctx=900, hq=16, hkv=8, head_dim=128, dtype=torch.bfloat16,
              timed=True)
    run_decode(**w1)
    for cache in (torch.float8_e4m3fn, torch.float8_e5m2):
        run_decode(**w1, cache_dtype=cache)
    for tiles in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3), (32, 4, 3)):
        if time.time() - t0 > budget_s:
            print("budget reached: skipping the rest of the FP8 sweep")
            return
        try:
            run_decode(**w1, cache_dtype=torch.float8_e4m3fn, tiles=tiles)
        except Exception as e:  # NOTE: a tile too big for shared memory is data, not a bug
            print(f"decode   fp8 tiles={tiles}: {type(e).__name__}: {e}"[:200])
    for batch, ctx in ((256, 8192), (64, 1024)):
        run_decode(batch, ctx, 32, 8, 128, torch.bfloat16, timed=True)
        run_decode(batch, ctx, 32, 8, 128, torch.bfloat16, timed=True,
                   cache_dtype=torch.float8_e4m3fn)
    run_extend([(1024, 3072)] * 2, 32, 8, 128, torch.bfloat16, timed=True,
               cache_dtype=torch.float8_e4m3fn)
    tokens, hkv, head_dim = 4096, 8, 128
    slots = torch.randperm(tokens * 2, device=DEV)[:tokens]
    slots[::7] = -1
    kv = torch.randn(tokens, 2, hkv, head_dim, device=DEV, dtype=torch.bfloat16) * 3
    kv[0, 0, 0, :2] = torch.tensor([1e4, -1e4])  # saturates
    kc = torch.zeros(tokens * 2 // 16, 16, hkv, head_dim, device=DEV, dtype=torch.float8_e4m3fn)
    vc, kc_ref, vc_ref = kc.clone(), kc.clone(), kc.clone()
    store_kv(kv[:, 0], kv[:, 1], kc, vc, slots, K_SCALE, V_SCALE)
    ref.store_kv_ref(kv[:, 0], kv[:, 1], kc_ref, vc_ref, slots, K_SCALE, V_SCALE)
    mismatched = ((kc.view(torch.uint8) != kc_ref.view(torch.uint8)).sum()
                  + (vc.view(torch.uint8) != vc_ref.view(torch.uint8)).sum()).item()
    ms = bench(lambda: store_kv(kv[:, 0], kv[:, 1], kc, vc, slots, K_SCALE, V_SCALE))
    record("store_kv", dict(dtype="bfloat16", cache="float8_e4m3fn", T=tokens, hkv=hkv,
                            D=head_dim, unit="mismatched bytes"), float(mismatched), 0.0, ms,
           kv.numel() * (2 + 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="stop starting new timed cases after this many seconds")
    parser.add_argument("--fp8-only", action="store_true",
                        help="only the FP8 KV cache cases (bf16 vs FP8 decode at W1's shape)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    torch.manual_seed(0)
    t0 = time.time()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    if args.fp8_only:
        run_fp8(t0, args.budget_s)
        return _finish(t0)
    # decode at the Llama-8B-like shape (bf16, D=128, 32/8) plus MQA
    for hq, hkv in [(32, 8), (32, 1)]:
        for batch in (1, 8, 64, 256):
            for ctx in (128, 1024, 8192):
                if time.time() - t0 > args.budget_s:
                    print("budget reached: skipping the remaining timed cases")
                    return _finish(t0)
                run_decode(batch, ctx, hq, hkv, 128, torch.bfloat16, timed=True)
    # a graph-style block table sized for 32k tokens with 1k-token contexts
    run_decode(8, 1024, 32, 8, 128, torch.bfloat16, timed=True, width=2048)
    for chunks in ([(512, 0)] * 4, [(2048, 0)], [(4096, 0)], [(1024, 3072)] * 2,
                   [(512, 7680)] * 2):
        if time.time() - t0 > args.budget_s:
            break
        run_extend(chunks, 32, 8, 128, torch.bfloat16, timed=True)
        if chunks == [(4096, 0)]:
            run_extend(chunks, 32, 8, 64, torch.bfloat16, timed=True)
    run_elementwise(torch.bfloat16)
    run_fp8(t0, args.budget_s)
    # a small tile sweep for the prefill kernel, to tune _default_blocks
    for head_dim in (128, 64):
        for tiles in ((64, 64, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8), (64, 32, 4)):
            if time.time() - t0 > args.budget_s:
                return _finish(t0)
            try:
                run_extend([(4096, 0)], 32, 8, head_dim, torch.bfloat16, timed=True, tiles=tiles)
            except Exception as e:  # NOTE: a tile too big for shared memory is data, not a bug
                print(f"extend   D={head_dim} tiles={tiles}: {type(e).__name__}: {e}"[:200])
    return _finish(t0)


def _finish(t0: float) -> int:
    print(f"{len(RESULTS)} cases in {time.time() - t0:.0f} s; {len(FAILED)} failed")
    for f in FAILED:
        print("FAILED:", f)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        payload = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       peak_gbs=PEAK_GBS, peak_tflops=PEAK_TFLOPS, results=RESULTS,
                       failed=FAILED)
        (Path(out_dir) / "gpu_kernels.json").write_text(json.dumps(payload, indent=1))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
