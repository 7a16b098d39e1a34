"""Paged decode attention: which split-kernel variant and tiles read a bf16 or FP8 KV cache fastest.

Usage (H200): python benchmarks/decode_attn_bench.py --out /tmp/decode_attn.json [--budget-s 160]
    [--shapes w1mid,w1late,w1,llama8b] [--caches bf16,fp8]
Shapes (head dim 128, block 16): Qwen3-0.6B (16 q / 8 kv heads) as W1 (`peregrine bench
throughput`, 256 requests, max_model_len 2,048) runs it: w1mid = 180 sequences of 900-1,020
tokens (step ~400), w1late = 75 of 1,150-1,250, each padded like a decode CUDA graph (to a
multiple of 16 with empty sequences) over a 2,048-token block table; w1 = 1,000 sequences of
900-1,100 tokens; llama8b = Llama-3-8B (32 q / 8 kv heads), 256 sequences of 1,800-2,200 tokens.
Caches: bf16, and FP8 e4m3 holding k / K_SCALE, v / V_SCALE (bf16 queries either way).
Phase 1 times the launcher's default, the choice it replaced ("previous") and a list of
starting points (PHASE1: changes to the former single choice, every variant and option of
decode_configs.DecodeConfig) for every (shape, cache) (--quick: only the prefetched starts
and the "fma" starts that read 2 or 4 adjacent kv heads a program;
--probe first times a bare paged read of the same caches, no math, with 1, 2, 4 or 8 kv heads
per program: the bandwidth the access pattern itself allows, by contiguous bytes per token row);
phase 2 walks one knob at a time (BLOCK_N, num_warps, num_stages, programs per
SM, prefetch, clamped tokens, aligned tiles, inline-PTX FP8 conversion, heads-first grid, kv
heads per program) away
from each variant's best on the FP8 pairs, then from each pair's best, until the budget is
spent. Each config: triton.testing.do_bench (no CUDA
graph, warm-up first), µs, GB/s (K+V read + q + output) against the 4.2 TB/s HBM peak, the
max abs error against the fp32 torch reference on the same (dequantized) cache, the split count
and the split programs that read keys; a config that fails to compile is printed and skipped;
variants that read FP8 caches only are not tried on bf16. The best correct config per (shape, cache) is printed
last and written to --out.

--ncu: one launch of each chosen config (no timing, no reference), for
    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section LaunchStats -k regex:decode python benchmarks/decode_attn_bench.py --ncu \\
        --from /tmp/decode_attn.json --out /tmp/ncu_configs.json
  with --from: the best config of each (shape, cache) in that result file plus the launcher's
  default; without: the default and the PHASE1 starting points.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peregrine.kernels import reference as ref  # noqa: E402
from peregrine.kernels._utils import max_shared_memory  # noqa: E402
from peregrine.kernels.decode_attention import (FP8_ONLY_VARIANTS, GPU_ONLY_VARIANTS,  # noqa: E402
                                                VARIANTS, decode_num_splits,
                                                paged_decode_attention, pick_config)
from peregrine.kernels.decode_attention import _MIN_SPLIT_LEN as MIN_SPLIT_LEN  # noqa: E402
from peregrine.kernels.decode_attention_mma import usable as mma_fp8_unusable  # noqa: E402
from peregrine.kernels.decode_configs import DecodeConfig  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

PEAK_GBS = 4200.0  # H200 HBM3e
TOL = 3e-2  # max abs error of a bf16 output against the fp32 reference (outputs are O(1))
K_SCALE, V_SCALE = 0.021, 0.017  # randn K/V / 0.02 stays inside e4m3's +-448


class Shape(NamedTuple):
    batch: int
    min_ctx: int
    max_ctx: int
    q_heads: int
    kv_heads: int
    table_tokens: int | None = None  # block-table width in tokens (None: the longest sequence)
    graph_pad: bool = False  # pad the batch to a multiple of 16 with empty sequences


SHAPES = {
    "w1mid": (180, 900, 1020, 16, 8, 2048, True),
    "w1late": (75, 1150, 1250, 16, 8, 2048, True),
    "w1": (1000, 900, 1100, 16, 8),
    "llama8b": (256, 1800, 2200, 32, 8),
}
CACHES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
HEAD_DIM, BLOCK_SIZE = 128, 16
DEV = torch.device("cuda")


class Cfg(DecodeConfig):
    """A launch config of the split kernel (decode_configs.DecodeConfig) with its table label."""

    def label(self) -> str:
        return (f"{self.variant:6s} bn={self.block_n:<3d} w={self.num_warps} s={self.num_stages} "
                f"pf={int(self.prefetch)} ct={int(self.clamp_tokens)} al={int(self.aligned)} "
                f"asm={int(self.asm_cvt)} hf={int(self.heads_first)} "
                f"kvh={self.kv_heads_per_program} pps={self.programs_per_sm:<3d}")


# Phase 1: starting points, each a change to FORMER (the single choice before the variants);
# the launcher's current choice for the (shape, cache) is timed too ("default").
FORMER = dict(variant="dot", block_n=64, num_warps=4, num_stages=2, prefetch=False,
              clamp_tokens=False, aligned=False, asm_cvt=False, heads_first=False)
PHASE1 = (
    dict(),
    dict(heads_first=True),
    dict(variant="fma", block_n=16, num_warps=2, num_stages=3),
    dict(variant="fma", block_n=16, num_warps=2, num_stages=3, heads_first=True),
    dict(num_warps=2, clamp_tokens=True, aligned=True),
    dict(num_warps=2, clamp_tokens=True, aligned=True, heads_first=True),
    dict(clamp_tokens=True, aligned=True),
    dict(clamp_tokens=True, aligned=True, heads_first=True),
    dict(aligned=True, asm_cvt=True, num_stages=1),
    dict(aligned=True, asm_cvt=True, num_stages=1, heads_first=True),
    dict(variant="dot_kt", aligned=True),
    # the dot with a prefetched tile converted to fp16 in registers: tiles, warps, split counts
    dict(block_n=32, num_warps=2, num_stages=1, prefetch=True, clamp_tokens=True, aligned=True,
         asm_cvt=True, programs_per_sm=32),
    dict(block_n=32, num_warps=2, num_stages=1, prefetch=True, clamp_tokens=True, aligned=True,
         asm_cvt=True, programs_per_sm=4),
    dict(block_n=32, num_warps=2, num_stages=1, prefetch=True, clamp_tokens=True, aligned=True,
         asm_cvt=True, programs_per_sm=64),
    dict(block_n=32, num_warps=4, num_stages=1, prefetch=True, clamp_tokens=True, aligned=True,
         asm_cvt=True, programs_per_sm=32),
    dict(block_n=64, num_warps=4, num_stages=1, prefetch=True, clamp_tokens=True, aligned=True,
         asm_cvt=True, programs_per_sm=32),
    # CUDA-core math on FP8 words (FP8 caches only): prefetched, aligned, clamped; tile tokens,
    # warps, split counts, no prefetch
    dict(variant="fma_fp8", block_n=16, num_warps=2, num_stages=1, prefetch=True,
         clamp_tokens=True, aligned=True, asm_cvt=True, programs_per_sm=32),
    dict(variant="fma_fp8", block_n=16, num_warps=2, num_stages=1, prefetch=True,
         clamp_tokens=True, aligned=True, asm_cvt=True, programs_per_sm=4),
    dict(variant="fma_fp8", block_n=16, num_warps=2, num_stages=1, prefetch=True,
         clamp_tokens=True, aligned=True, asm_cvt=True, programs_per_sm=64),
    dict(variant="fma_fp8", block_n=32, num_warps=2, num_stages=1, prefetch=True,
         clamp_tokens=True, aligned=True, asm_cvt=True, programs_per_sm=32),
    dict(variant="fma_fp8", block_n=16, num_warps=4, num_stages=1, prefetch=True,
         clamp_tokens=True, aligned=True, asm_cvt=True, programs_per_sm=32),
    dict(variant="fma_fp8", block_n=16, num_warps=2, num_stages=1, clamp_tokens=True,
         aligned=True, asm_cvt=True, programs_per_sm=32),
    # "fma" over 2 or 4 adjacent kv heads a program (HEADS x 128 contiguous FP8 bytes a token
    # instead of 128): the launcher's FP8 choice with the warps that keep the wider tile in
    # registers (sm_90: 2 heads 4 warps 164 registers, 4 heads 8 warps 172, no spills)
    dict(variant="fma", block_n=16, num_warps=4, num_stages=3, kv_heads_per_program=2),
    dict(variant="fma", block_n=16, num_warps=2, num_stages=3, kv_heads_per_program=2),
    dict(variant="fma", block_n=16, num_warps=4, num_stages=3, kv_heads_per_program=2,
         heads_first=True),
    dict(variant="fma", block_n=16, num_warps=4, num_stages=3, kv_heads_per_program=2,
         clamp_tokens=True, aligned=True),
    dict(variant="fma", block_n=16, num_warps=8, num_stages=3, kv_heads_per_program=4),
    dict(variant="fma", block_n=16, num_warps=4, num_stages=3, kv_heads_per_program=4),
)
# The starts --quick times besides the default and previous choices.
QUICK = [s for s in PHASE1 if s.get("prefetch") or s.get("kv_heads_per_program", 1) > 1]
# The launcher's choices before 16 programs per SM and the heads-first grid, timed beside the
# current ones ("previous"): a bf16 cache, and an FP8 cache with up to 2 q heads per kv head.
PREVIOUS_BF16 = dict(variant="dot", block_n=64, num_warps=4, num_stages=2, prefetch=False,
                     programs_per_sm=4, clamp_tokens=True, aligned=True, asm_cvt=False,
                     heads_first=False)
PREVIOUS_FP8_SMALL_GROUP = dict(variant="fma", block_n=16, num_warps=2, num_stages=3,
                                prefetch=False, programs_per_sm=4, clamp_tokens=False,
                                aligned=False, asm_cvt=False, heads_first=False)
# Phase 2 knob values (one knob moved at a time).
KNOBS = {"block_n": {"dot": (32, 64, 128), "dot_kt": (32, 64, 128), "fma": (16, 32, 64),
                     "fma_fp8": (16, 32, 64), "mma_fp8": (16,)},
         "num_warps": (2, 4, 8), "num_stages": (1, 2, 3, 4),
         "programs_per_sm": (4, 16, 32, 64, 128),
         "prefetch": (False, True), "clamp_tokens": (False, True), "aligned": (False, True),
         "asm_cvt": (False, True), "heads_first": (False, True),
         "kv_heads_per_program": (1, 2, 4)}  # ("fma" only)


class Problem(NamedTuple):
    shape: str
    cache: str
    q: torch.Tensor  # (B, Hq, D) bf16
    k_cache: torch.Tensor  # (blocks, 16, Hkv, D)
    v_cache: torch.Tensor
    block_table: torch.Tensor  # (B, width) int32
    seq_lens: torch.Tensor  # (B,) int32
    nbytes: float  # K + V read + q + output
    expected: torch.Tensor | None  # (B, Hq, D) fp32 reference
    lens: list[int]  # seq_lens on the host


def device_name() -> str:
    return torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"


def make_problem(shape: str, cache: str, with_reference: bool) -> Problem:
    real, lo, hi, hq, hkv, table_tokens, graph_pad = Shape(*SHAPES[shape])
    gen = torch.Generator().manual_seed(real + hi)
    batch = -(-real // 16) * 16 if graph_pad else real
    lens = torch.zeros(batch, dtype=torch.int64)  # (B,) padding sequences are empty
    lens[:real] = torch.randint(lo, hi + 1, (real,), generator=gen)
    nbs = (lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    width = max(int(nbs.max()), -(-(table_tokens or 0) // BLOCK_SIZE))
    perm = torch.randperm(int(nbs.sum()), generator=gen).to(torch.int32)
    block_table = torch.zeros(batch, width, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(nbs.tolist()):  # shuffled physical blocks, like a served cache
        block_table[i, :nb] = perm[used:used + nb]
        used += nb
    shape4 = (used, BLOCK_SIZE, hkv, HEAD_DIM)
    torch.manual_seed(real + hi)
    kc = torch.randn(shape4, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn(shape4, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(batch, hq, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    ks = vs = 1.0
    if CACHES[cache] != torch.bfloat16:
        ks, vs = K_SCALE, V_SCALE
        kc = ref.quantize_kv_ref(kc, CACHES[cache], ks)
        vc = ref.quantize_kv_ref(vc, CACHES[cache], vs)
    bt, sl = block_table.to(DEV), lens.to(torch.int32).to(DEV)
    expected = None
    if with_reference:
        # NOTE: attention on (k * ks, v * vs) is attention on k with scale * ks, times vs.
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        expected = ref.paged_attention_ref(q.float(), kc, vc, bt, sl, qsl,
                                           HEAD_DIM ** -0.5 * ks) * vs
    nbytes = (2.0 * int(lens.sum()) * hkv * HEAD_DIM * kc.element_size()
              + 2.0 * q.numel() * q.element_size())
    return Problem(shape, cache, q, kc, vc, bt, sl, nbytes, expected, lens.tolist())


def launch(p: Problem, cfg: Cfg, out: torch.Tensor) -> None:
    ks, vs = (1.0, 1.0) if p.cache == "bf16" else (K_SCALE, V_SCALE)
    paged_decode_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                           HEAD_DIM ** -0.5, out=out, num_splits=num_splits(p, cfg),
                           block_n=cfg.block_n,
                           k_scale=ks, v_scale=vs, num_warps=cfg.num_warps,
                           num_stages=cfg.num_stages, variant=cfg.variant, prefetch=cfg.prefetch,
                           clamp_tokens=cfg.clamp_tokens, aligned=cfg.aligned,
                           asm_cvt=cfg.asm_cvt, heads_first=cfg.heads_first,
                           kv_heads_per_program=cfg.kv_heads_per_program)


def default_cfg(p: Problem) -> Cfg:
    group = p.q.shape[1] // p.k_cache.shape[2]
    mma = mma_fp8_unusable(p.q, p.k_cache, group, BLOCK_SIZE) is None
    return Cfg(*pick_config(p.q.dtype, p.k_cache.dtype, group, True, max_shared_memory(DEV),
                            fp8_mma=mma))


PROBE_HEADS = (1, 2, 4, 8)  # kv heads per program: contiguous bytes per token row read


@triton.jit
def _read_probe_kernel(k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, stride_b, stride_s, stride_h,
                       stride_bt, HEADS: tl.constexpr, WORDS: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """XOR of every 32-bit word of K and V that program (b, head group) would read: the
    decode kernel's paged access pattern with no math, HEADS kv heads side by side."""
    b = tl.program_id(0)
    hg = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    offs_n = tl.arange(0, BLOCK_N)  # (BN,)
    col = ((hg * HEADS + tl.arange(0, HEADS))[:, None] * stride_h
           + tl.arange(0, WORDS)[None, :])  # (H, W) words
    acc = tl.zeros([BLOCK_N, HEADS, WORDS], tl.int32)
    for n0 in range(0, seq_len, BLOCK_N):
        tok = n0 + offs_n  # (BN,)
        mask = tok < seq_len
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + tok // BLOCK_SIZE, mask=mask,
                      other=0).to(tl.int64)  # (BN,)
        ptrs = (blk * stride_b + (tok % BLOCK_SIZE) * stride_s)[:, None, None] + col[None]
        m3 = mask[:, None, None]
        acc = acc ^ tl.load(k_ptr + ptrs, mask=m3, other=0) ^ tl.load(v_ptr + ptrs, mask=m3,
                                                                        other=0)
    x = tl.xor_sum(tl.xor_sum(tl.xor_sum(acc, 2), 1), 0)
    tl.store(out_ptr + b * tl.num_programs(1) + hg, x)


def read_probe(p: Problem, heads: int, out: torch.Tensor) -> None:
    """Launch the read probe over p's caches (viewed as 32-bit words), `heads` kv heads per
    program; out (B, Hkv / heads) int32."""
    kw, vw = p.k_cache.view(torch.int32), p.v_cache.view(torch.int32)
    _read_probe_kernel[(p.q.shape[0], p.k_cache.shape[2] // heads)](
        kw, vw, p.block_table, p.seq_lens, out, kw.stride(0), kw.stride(1), kw.stride(2),
        p.block_table.stride(0), HEADS=heads, WORDS=kw.shape[3], BLOCK_SIZE=BLOCK_SIZE,
        BLOCK_N=max(4, 32 // heads), num_warps=4)  # the same 32 token rows per tile


def probe_expected(p: Problem, heads: int) -> torch.Tensor:
    """The probe's answer computed on the host (a check that it reads exactly the bytes):
    per sequence and kv head once, then XOR-folded over each group of `heads`."""
    import numpy as np
    kw = p.k_cache.view(torch.int32).cpu().numpy()
    vw = p.v_cache.view(torch.int32).cpu().numpy()
    bt = p.block_table.cpu().numpy()
    hkv = p.k_cache.shape[2]
    per_head = np.zeros((len(p.lens), hkv), np.int32)
    for b, n in enumerate(p.lens):
        if n == 0:
            continue
        tok = np.arange(n)
        x = np.bitwise_xor(kw[bt[b, tok // BLOCK_SIZE], tok % BLOCK_SIZE],
                           vw[bt[b, tok // BLOCK_SIZE], tok % BLOCK_SIZE])  # (n, Hkv, W)
        per_head[b] = np.bitwise_xor.reduce(np.bitwise_xor.reduce(x, 2), 0)
    grouped = np.bitwise_xor.reduce(per_head.reshape(len(p.lens), hkv // heads, heads), 2)
    return torch.from_numpy(np.ascontiguousarray(grouped))


def probe_expected_from(per_head: torch.Tensor, heads: int) -> torch.Tensor:
    """probe_expected at `heads` kv heads per program from its answer at one."""
    out = per_head[:, 0::heads].clone()
    for i in range(1, heads):
        out ^= per_head[:, i::heads]
    return out


def run_probe(problems: dict[tuple[str, str], Problem], check: bool) -> list[dict]:
    """Bandwidth of the bare paged read per (shape, cache) and kv heads per program: what the
    access pattern allows before any math (bytes: K + V of the real tokens)."""
    rows = []
    for (shape, cache), p in problems.items():
        kv_bytes = 2.0 * sum(p.lens) * p.k_cache.shape[2] * HEAD_DIM * p.k_cache.element_size()
        for heads in PROBE_HEADS:
            if p.k_cache.shape[2] % heads:
                continue
            out = torch.empty(p.q.shape[0], p.k_cache.shape[2] // heads, dtype=torch.int32,
                              device=DEV)
            read_probe(p, heads, out)
            if check and heads == 1:  # the host's answer once per problem, folded per group
                per_head = probe_expected(p, 1)
            ok = (bool(torch.equal(out.cpu(), probe_expected_from(per_head, heads))) if check
                  else None)
            ms = bench_ms(lambda: read_probe(p, heads, out))
            gbs = kv_bytes / ms / 1e6
            rows.append(dict(shape=shape, cache=cache, heads_per_program=heads,
                             row_bytes=heads * HEAD_DIM * p.k_cache.element_size(), us=ms * 1e3,
                             gbs=gbs, pct_hbm=100 * gbs / PEAK_GBS, ok=ok))
            print(f"probe {shape:8s} {cache:5s} {heads} kv heads/program "
                  f"({rows[-1]['row_bytes']:4d} B per token row) {ms * 1e3:8.1f} us "
                  f"{gbs:6.0f} GB/s ({rows[-1]['pct_hbm']:4.1f}%)"
                  f"{'' if ok in (True, None) else ' WRONG'}", flush=True)
    return rows


def bench_ms(fn) -> float:
    """Mean ms per call: triton.testing.do_bench (warm-up first, L2 flushed, no CUDA graph)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=40)


def num_splits(p: Problem, cfg: Cfg) -> int:
    """The launcher's split count for cfg: programs per SM over (sequence, kv-head row)."""
    return decode_num_splits(p.q.shape[0], p.k_cache.shape[2] // cfg.kv_heads_per_program,
                             p.block_table.shape[1], BLOCK_SIZE, DEV, cfg.programs_per_sm)


def seq_split_len(n: int, splits: int, cfg: Cfg) -> int:
    """Tokens per split of a sequence of n tokens (the kernel's own rule)."""
    per = -(-(-(-n // splits)) // cfg.block_n) * cfg.block_n
    return max(per, -(-MIN_SPLIT_LEN // cfg.block_n) * cfg.block_n)


def num_programs(p: Problem, cfg: Cfg) -> int:
    """Split programs that read keys (the others exit at once): what fills the GPU's waves."""
    splits = num_splits(p, cfg)
    return (sum(-(-n // seq_split_len(n, splits, cfg)) for n in p.lens if n)
            * (p.k_cache.shape[2] // cfg.kv_heads_per_program))


def previous_cfg(p: Problem) -> Cfg | None:
    """The launcher's former choice where the last change replaced it (bf16; FP8, group <= 2)."""
    group = p.q.shape[1] // p.k_cache.shape[2]
    if p.cache == "bf16":
        return Cfg(**PREVIOUS_BF16)
    return Cfg(**PREVIOUS_FP8_SMALL_GROUP) if group <= 2 else None


def former_cfg(p: Problem) -> Cfg:
    """The single choice the launcher made before the variants existed."""
    return Cfg(programs_per_sm=default_cfg(p).programs_per_sm, **FORMER)


def measure(p: Problem, cfg: Cfg, rows: list[dict], tag: str) -> dict:
    row = dict(shape=p.shape, cache=p.cache, tag=tag, **cfg._asdict())
    row["num_splits"] = num_splits(p, cfg)
    row["programs"] = num_programs(p, cfg)
    out = torch.empty_like(p.q)
    t = time.time()
    try:
        launch(p, cfg, out)  # compiles
        if DEV.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # NOTE: a config that does not compile (shared memory) is data
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
        print(f"{p.shape:8s} {p.cache:5s} {cfg.label()}  FAILED TO COMPILE: {row['error'][:160]}",
              flush=True)
        rows.append(row)
        return row
    row["compile_s"] = time.time() - t
    err = (out.float() - p.expected).abs().max().item()
    ms = bench_ms(lambda: launch(p, cfg, out))
    gbs = p.nbytes / ms / 1e6
    row.update(max_err=err, ok=err <= TOL, us=ms * 1e3, gbs=gbs, pct_hbm=100 * gbs / PEAK_GBS)
    rows.append(row)
    print(f"{p.shape:8s} {p.cache:5s} {cfg.label()}  {row['us']:8.1f} us {gbs:6.0f} GB/s "
          f"({row['pct_hbm']:4.1f}% of 4.2 TB/s)  err={err:.1e}{'' if row['ok'] else ' FAIL'}"
          f"  splits={row['num_splits']} programs={row['programs']} [{tag}]", flush=True)
    return row


def normalized(p: Problem, cfg: Cfg) -> Cfg:
    """cfg with the options that do nothing for this cache and variant turned off, so that
    configs that compile to the same kernel are timed once."""
    if p.cache == "bf16" or cfg.variant == "fma":
        cfg = cfg._replace(asm_cvt=False)
    return cfg


def best_of(rows: list[dict], shape: str, cache: str, variant: str | None = None) -> dict | None:
    """The fastest correct row of (shape, cache), of one variant if given."""
    ok = [r for r in rows if r["shape"] == shape and r["cache"] == cache and r.get("ok")
          and variant in (None, r["variant"])]
    return min(ok, key=lambda r: r["us"]) if ok else None


def neighbours(cfg: Cfg) -> list[Cfg]:
    """Configs one knob away from cfg."""
    out = []
    for knob, values in KNOBS.items():
        values = values[cfg.variant] if isinstance(values, dict) else values
        if knob == "kv_heads_per_program" and cfg.variant != "fma":
            continue
        out += [cfg._replace(**{knob: v}) for v in values if v != getattr(cfg, knob)]
    return out


def run_sweep(args: argparse.Namespace, t0: float) -> dict:
    rows: list[dict] = []
    pairs = [(s, c) for c in args.caches for s in args.shapes]
    pairs.sort(key=lambda sc: sc[1] == "bf16")  # FP8 first
    problems: dict[tuple[str, str], Problem] = {}
    for shape, cache in pairs:
        t = time.time()
        problems[shape, cache] = make_problem(shape, cache, with_reference=True)
        print(f"inputs and reference for {shape} {cache}: {time.time() - t:.1f} s", flush=True)
    probe = run_probe(problems, check=True) if args.probe else []
    seen: set[tuple] = set()

    def try_cfg(p: Problem, cfg: Cfg, tag: str) -> None:
        if p.cache == "bf16" and cfg.variant in FP8_ONLY_VARIANTS:
            return
        if p.k_cache.shape[2] % cfg.kv_heads_per_program:  # not a launch of this model
            return
        cfg = normalized(p, cfg)
        # NOTE: programs per SM only matter through the split count they give.
        key = (p.shape, p.cache, cfg._replace(programs_per_sm=num_splits(p, cfg)))
        if key not in seen:
            seen.add(key)
            measure(p, cfg, rows, tag)

    print("phase 1: every variant at base tiles", flush=True)
    for key in pairs:
        p = problems[key]
        try_cfg(p, default_cfg(p), "default")
        if previous_cfg(p) is not None:
            try_cfg(p, previous_cfg(p), "previous")
        for start in QUICK if args.quick else PHASE1:
            try_cfg(p, former_cfg(p)._replace(**start), "base" if start else "former")
    print(f"phase 1 done at {time.time() - t0:.0f} s; phase 2: one knob at a time", flush=True)
    # First each variant's own best on the FP8 pairs (a variant may lose at base tiles and win
    # tuned), then the overall best of every pair, repeated while it improves.
    rounds = [(key, variant) for key in pairs if key[1] != "bf16" for variant in VARIANTS]
    overall, improved = [(key, None) for key in pairs], True
    while time.time() - t0 < args.budget_s and (rounds or improved):
        todo, rounds = rounds or overall, []
        improved = False
        for key, variant in todo:
            best = best_of(rows, *key, variant)
            if best is None:
                continue
            start_us = best["us"]
            for cfg in neighbours(Cfg(*(best[f] for f in Cfg._fields))):
                if time.time() - t0 > args.budget_s:
                    print("budget reached", flush=True)
                    break
                try_cfg(problems[key], cfg, "sweep")
            # NOTE: the per-variant rounds always lead to an overall round.
            improved |= variant is not None or best_of(rows, *key)["us"] < start_us
    result = dict(device=device_name(), torch=torch.__version__,
                  triton=__import__("triton").__version__, peak_gbs=PEAK_GBS, tol=TOL,
                  shapes={s: SHAPES[s] for s in args.shapes}, results=rows, best={},
                  probe=probe)
    print(f"\n{len(rows)} configs in {time.time() - t0:.0f} s. Best per (shape, cache):")
    for key in pairs:
        ref_us = {tag: next((r["us"] for r in rows if (r["shape"], r["cache"]) == key
                             and r["tag"] == tag and r.get("ok")), None)
                  for tag in ("default", "previous", "former")}
        best = best_of(rows, *key)
        result["best"][f"{key[0]}/{key[1]}"] = best
        if best is None:
            print(f"  {key[0]:8s} {key[1]:5s} no correct config")
            continue
        vs = ", ".join(f"{tag} {us:.1f} us" for tag, us in ref_us.items() if us is not None)
        print(f"  {key[0]:8s} {key[1]:5s} {Cfg(*(best[f] for f in Cfg._fields)).label()}  "
              f"{best['us']:8.1f} us {best['gbs']:6.0f} GB/s  ({vs})")
    for variant in VARIANTS:  # each variant's own best, to see which idea carries
        for key in pairs:
            mine = [r for r in rows if (r["shape"], r["cache"]) == key and r.get("ok")
                    and r["variant"] == variant]
            if mine:
                b = min(mine, key=lambda r: r["us"])
                print(f"  best {variant:6s} {key[0]:8s} {key[1]:5s} {b['us']:8.1f} us "
                      f"{b['gbs']:6.0f} GB/s  bn={b['block_n']} w={b['num_warps']} "
                      f"s={b['num_stages']} pf={int(b['prefetch'])} "
                      f"ct={int(b['clamp_tokens'])} al={int(b['aligned'])} "
                      f"asm={int(b['asm_cvt'])} hf={int(b['heads_first'])} "
                      f"kvh={b['kv_heads_per_program']} pps={b['programs_per_sm']}")
    failed = [r for r in rows if "max_err" in r and not r["ok"]]
    for r in failed:
        print(f"WRONG RESULT: {r['shape']} {r['cache']} {r['variant']} err={r['max_err']:.3g}")
    return result


def run_ncu(args: argparse.Namespace) -> dict:
    """One launch per chosen config, for a profiler attached from outside."""
    chosen: list[tuple[str, str, Cfg]] = []
    best = json.loads(Path(args.from_json).read_text())["best"] if args.from_json else {}
    for cache in args.caches:
        for shape in args.shapes:
            p = make_problem(shape, cache, with_reference=False)
            cfgs = [default_cfg(p)] + ([previous_cfg(p)] if previous_cfg(p) else [])
            row = best.get(f"{shape}/{cache}")
            if row:
                cfgs.append(Cfg(**{f: row[f] for f in Cfg._fields if f in row}))
            elif not args.from_json:
                cfgs += [former_cfg(p)._replace(**start) for start in PHASE1]
            out = torch.empty_like(p.q)
            for cfg in dict.fromkeys(normalized(p, c) for c in cfgs
                                     if (cache != "bf16" or c.variant not in FP8_ONLY_VARIANTS)
                                     and p.k_cache.shape[2] % c.kv_heads_per_program == 0):
                print(f"ncu launch: {shape} {cache} {cfg.label()}", flush=True)
                try:
                    launch(p, cfg, out)
                    if DEV.type == "cuda":
                        torch.cuda.synchronize()
                    chosen.append((shape, cache, cfg))
                except Exception:
                    traceback.print_exc()
            del p
    return dict(ncu=[dict(shape=s, cache=c, **cfg._asdict()) for s, c, cfg in chosen])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="write the results here as JSON")
    parser.add_argument("--budget-s", type=float, default=160.0,
                        help="stop starting new configs after this many seconds")
    parser.add_argument("--shapes", default="w1mid,w1late,w1,llama8b",
                        help=f"subset of {list(SHAPES)}")
    parser.add_argument("--caches", default="bf16,fp8", help=f"subset of {list(CACHES)}")
    parser.add_argument("--quick", action="store_true",
                        help="phase 1 times only the default, the previous FP8 choice, the "
                             "prefetched starts and the several-kv-heads-a-program starts "
                             "(with --budget-s 0: no phase 2)")
    parser.add_argument("--probe", action="store_true",
                        help="first time a bare paged read of the caches (no math) at 1, 2, 4 "
                             "and 8 kv heads per program, checked against the host")
    parser.add_argument("--ncu", action="store_true", help="one launch per chosen config")
    parser.add_argument("--from", dest="from_json", help="--ncu: the best configs of this file")
    args = parser.parse_args()
    args.shapes = args.shapes.split(",")
    args.caches = args.caches.split(",")
    bad = [s for s in args.shapes if s not in SHAPES] + [c for c in args.caches if c not in CACHES]
    if bad:
        parser.error(f"unknown shape or cache {bad}: shapes {list(SHAPES)}, caches {list(CACHES)}")
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    t0 = time.time()
    print(f"device: {device_name()}  torch {torch.__version__}", flush=True)
    result = run_ncu(args) if args.ncu else run_sweep(args, t0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} after {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
