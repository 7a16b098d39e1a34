"""How fast can a GEMV's tiling stream its weights at all? A kernel that only loads 4-bit packed
words (int32) and folds them into an integer sum, launched on the one-row GEMV's grid (column
tiles x K splits), timed at Llama-3-8B's projection shapes over a grid of tiles, K splits,
warps and loads in flight; beside it the packed-half GEMV (kernels/wna16_gemv.py, `half2_prefetch`)
at the same shapes. Where the probe reaches the bandwidth wall and the GEMV does not, the GEMV
loses its time to arithmetic and latency, not to how its tiles meet memory.

    python benchmarks/gemv_stream_probe.py --out /tmp/out/stream_probe.json

Two layouts: `kn`, the GEMV's (K/8 word rows, N columns, a block reads BLOCK_N-column runs of
each row) and `nk` (N rows of K/8 words, a block reads each column's run of words).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import graph_replay_ms  # noqa: E402
from benchmarks.gemv_bench import HBM_GBPS, SHAPES, _copies, _wna16  # noqa: E402


@triton.jit(do_not_specialize=["K_ITERS"])
def _stream_kernel(q_ptr, out_ptr, N, KW, K_ITERS, KN: tl.constexpr, BLOCK_N: tl.constexpr,
                   WORDS: tl.constexpr, AHEAD: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    offs_w = tl.arange(0, WORDS)  # (W,)
    row0 = split * K_ITERS * WORDS
    if KN:  # word (r, n) at r * N + n
        ptrs = q_ptr + (row0 + offs_w)[:, None] * N + offs_n[None, :]  # (W, BN)
        step = WORDS * N
    else:  # word (r, n) at n * KW + r
        ptrs = q_ptr + offs_n[None, :] * KW + (row0 + offs_w)[:, None]  # (W, BN)
        step = WORDS
    acc = tl.zeros((WORDS, BLOCK_N), dtype=tl.int32)
    nxt = tl.load(ptrs)
    for it in range(K_ITERS):
        if AHEAD:
            cur = nxt
            if it + 1 < K_ITERS:
                nxt = tl.load(ptrs + (it + 1) * step)
        else:
            cur = tl.load(ptrs + it * step)
        acc += cur
    tl.store(out_ptr + split * N + offs_n, tl.sum(acc, axis=0))


def _splits(blocks: int, tiles: int, sms: int) -> list[int]:
    """Power-of-two K splits dividing the K blocks that launch 1 to 16 programs per SM."""
    out = []
    s = 1
    while s <= blocks:
        if blocks % s == 0 and sms <= tiles * s <= 16 * sms:
            out.append(s)
        s *= 2
    return out


def probe_shape(k: int, n: int, iters: int, dev: torch.device) -> dict:
    kw = k // 8
    nbytes = kw * n * 4
    copies = _copies(nbytes)
    mats = {"kn": [torch.randint(-2**31, 2**31 - 1, (kw, n), dtype=torch.int32, device=dev)
                   for _ in range(copies)]}
    mats["nk"] = [m.t().contiguous() for m in mats["kn"]]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = torch.empty(64 * n, dtype=torch.int32, device=dev)
    timings = []
    for layout, qs in mats.items():
        for bn in (32, 64, 128, 256):
            for words in (8, 16, 32):
                if n % bn or kw % words:
                    continue
                tiles, blocks = n // bn, kw // words
                for split in _splits(blocks, tiles, sms):
                    for warps in (4, 8):
                        for ahead in (0, 1):
                            calls = [lambda q=q, s=split: _stream_kernel[(tiles, s)](
                                q, out, n, kw, blocks // s, KN=layout == "kn", BLOCK_N=bn,
                                WORDS=words, AHEAD=ahead, num_warps=warps) for q in qs]
                            us = graph_replay_ms(calls, iters) * 1e3 / len(calls)
                            timings.append(dict(layout=layout, block_n=bn, words=words,
                                                split=split, warps=warps, ahead=ahead,
                                                us=round(us, 2),
                                                pct_hbm=round(100 * nbytes / us / 1e3 / HBM_GBPS,
                                                              1)))
    from peregrine.kernels.wna16_gemv import wna16_gemv
    ws = [_wna16(k, n, 4, True, dev) for _ in range(copies)]
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    gemv_us = graph_replay_ms([lambda w=w: wna16_gemv(x, w, variant="half2_prefetch")
                               for w in ws], iters) * 1e3 / len(ws)
    best = {lay: min((t for t in timings if t["layout"] == lay), key=lambda t: t["us"])
            for lay in mats}
    return dict(K=k, N=n, word_bytes=nbytes, gemv_half2_prefetch_us=round(gemv_us, 2),
                gemv_pct_hbm=round(100 * nbytes / gemv_us / 1e3 / HBM_GBPS, 1), best=best,
                timings=timings)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--shapes", default="qkv,o,gate_up,down")
    ns = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemv_stream_probe needs a CUDA GPU")
    dev = torch.device("cuda")
    t0 = time.time()
    results = {}
    for name in ns.shapes.split(","):
        k, n = SHAPES["8b"][name]
        r = probe_shape(k, n, ns.iters, dev)
        results[name] = r
        print(f"{name:8s} K={k:6d} N={n:6d} gemv {r['gemv_half2_prefetch_us']:6.2f} us "
              f"({r['gemv_pct_hbm']:.0f}% of HBM for the words)", flush=True)
        for lay, b in r["best"].items():
            print(f"    stream {lay}: {b['us']:6.2f} us ({b['pct_hbm']:.0f}%) bn={b['block_n']} "
                  f"words={b['words']} split={b['split']} warps={b['warps']} ahead={b['ahead']}",
                  flush=True)
        same = [t for t in r["timings"] if t["layout"] == "kn" and t["block_n"] == 128
                and t["words"] == 16 and t["ahead"] == 1 and t["warps"] == 4]
        for t in same:
            print(f"    stream kn 128x16 ahead split={t['split']}: {t['us']:6.2f} us "
                  f"({t['pct_hbm']:.0f}%)", flush=True)
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                            hbm_gbps=HBM_GBPS, seconds=round(time.time() - t0),
                                            shapes=results), indent=1))
    print(f"({time.time() - t0:.0f} s; JSON in {ns.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
