"""The paged decode kernel's launch rule: which variant, tile and options the split kernel runs
with, chosen from the device, the query and cache dtypes, the GQA group and whether the batch's kv
rows are fewer than the SMs (never from batch values), so one model runs, and precompiles, at most
two compiled variants."""
from __future__ import annotations

from typing import NamedTuple

import torch

from peregrine.kernels._utils import FP8_DTYPES

PROGRAMS_PER_SM = 4  # programs per SM that decode_num_splits aims at by default
# Shared memory per program (bytes) from which the bf16 cache gets 128-token tiles: two stages
# of K and V tiles take 128 KiB (Hopper allows 227 KiB, Ampere 163 KiB, Ada 99 KiB).
LARGE_SHARED_MEMORY = 200 * 1024


class DecodeConfig(NamedTuple):
    """How the split kernel runs: variant (one of VARIANTS), tokens per tile, warps, pipeline
    stages, register prefetch of the next tile, programs per SM the split length aims at, and
    whether tile tokens past the end re-read real cache rows (unpredicated loads) instead of
    being masked, whether tiles start on a multiple of block_n (hoisted addresses), and whether
    an FP8 tile of the dot variants is converted to fp16 in registers right after its load
    (inline PTX; CUDA sm_89+ only, ignored elsewhere and for 16-bit caches), and whether the
    grid puts the kv heads of a sequence next to each other (programs running at the same time
    then read whole token rows of the cache, not one head's slice of many sequences), and how
    many adjacent kv heads one program reads ("fma" only: a token's slice of the cache is then
    that many times longer; the kv head count must be a multiple of it)."""
    variant: str
    block_n: int
    num_warps: int
    num_stages: int
    prefetch: bool
    programs_per_sm: int
    clamp_tokens: bool
    aligned: bool
    asm_cvt: bool
    heads_first: bool = False
    kv_heads_per_program: int = 1


# The launch rule, by where the kernel runs and what it reads; the one place to change it. The
# CUDA choices are the fastest correct configs of benchmarks/decode_attn_bench.py on an H200
# (decode at W1's shape: 1,000 Qwen3-0.6B sequences of ~1,000 tokens, 16 q / 8 kv heads, and
# Llama-3-8B's: 256 sequences of ~2,000 tokens, 32 / 8), against the former single choice
# ("dot", 64 tokens, 4 warps, 2 stages, no option):
_CONFIGS = {
    # the interpreter: small tiles keep it fast
    "cpu": DecodeConfig("dot", 16, 4, 2, False, PROGRAMS_PER_SM, False, False, False),
    # NOTE: fp32 inputs run 3-pass tf32 dots on a GPU; a narrower tile keeps them from spilling.
    "cuda-fp32": DecodeConfig("dot", 32, 8, 2, False, PROGRAMS_PER_SM, False, False, False),
    # bf16 cache: 16 programs per SM, the kv heads of a sequence side by side. Over W1's whole
    # decode phase (benchmarks/decode_splits_bench.py: every 100th step, 8 layers in one CUDA
    # graph) 3.55 s of attention against 3.78 s with 4 programs per SM and the sequence-major
    # grid (W1 at 1,000 x ~1,000: 961 us, at the wall).
    "cuda-16bit-cache": DecodeConfig("dot", 64, 4, 2, False, 16, True, True, False,
                                     heads_first=True),
    # the same with 128-token tiles where a program may use LARGE_SHARED_MEMORY (Hopper) and the
    # batch's kv rows fill the SMs: 3.50 s over W1's decode phase. Below that a split is one
    # short tile (decode_min_split_len), and 64-token tiles halve a split's wait on its loads:
    # Llama-3-8B batch-1 decode (128-384 tokens of context) on an H200 with int4 weights 474.8
    # tok/s against 470.3 / 470.1 with 128-token tiles (32-token tiles 474.6, 16 474.4); as the
    # rule: int4 474.2, FP8 W8A8 388.0 (384.4-384.9 before), bf16 221.3 against 220.4.
    "cuda-16bit-cache-large-tiles": DecodeConfig("dot", 128, 4, 2, False, 16, True, True, False,
                                                 heads_first=True),
    # FP8 cache, up to 2 q heads per kv head: W1 (1,000 x ~1,000) 795 us (878 with the
    # tensor-core dot). At W1's real batches (H200): 180 x ~960 tokens 158.8 us, 75 x ~1,200
    # 101.5 us. Fewer instructions did not make it faster: the dot with a prefetched tile
    # converted on load (3.6 SASS instructions per K/V element against 7.2, 8 KB in flight per
    # program) took 177.2 / 104.8 / 901.3 us; the best at 180 x ~960 was this variant again
    # (157.7 us with the heads-first grid), not "fma_fp8" (5.8 instructions per element).
    # Over W1's decode phase (decode_splits_bench.py) 16 programs per SM and the heads-first
    # grid give 3.42 s of attention against 3.81 s; 2 or 4 kv heads a program were slower
    # (5.08 / 21.8 s).
    "cuda-fp8-cache-small-group": DecodeConfig("fma", 16, 2, 3, False, 16, False, False, False,
                                               heads_first=True),
    # FP8 cache, larger groups: Llama-3-8B 367 us (was 486)
    "cuda-fp8-cache": DecodeConfig("dot", 64, 2, 2, False, PROGRAMS_PER_SM, True, True, False),
    # FP8 cache where decode_attention_mma's kernel runs (sm_89+, up to 8 q heads per kv head):
    # one warp a program, tiles copied into 2 shared-memory stages, 8 programs per SM (one split
    # a sequence from 132 sequences up, written without the merge). Over W1's decode phase
    # (decode_splits_bench.py, H200): 2.051 s of attention; 2.165 s with 3 stages and 16
    # programs per SM, 2.348 s with the next tile in registers instead of shared memory; with 3
    # stages and 8 programs per SM, 2.075 s and 2.117 s with the merge kept at one split.
    "cuda-fp8-cache-mma": DecodeConfig("mma_fp8", 16, 1, 2, False, 8, False, True, False,
                                       heads_first=True),
}
# Whether FP8 caches use "cuda-fp8-cache-mma" where it runs.
FP8_MMA = True


def pick_config(q_dtype: torch.dtype, cache_dtype: torch.dtype, group: int,
                on_gpu: bool, shared_memory: int = 0, fp8_mma: bool = False,
                small_batch: bool = False) -> DecodeConfig:
    """The split kernel's launch choice from the device (on_gpu, and the shared memory one
    program may use there, 0 if unknown), the dtypes, the GQA group and small_batch only (never
    batch values), so one model runs, and precompile() compiles, a fixed set of variants.
    fp8_mma: the device and the model's shapes allow the "mma_fp8" variant
    (decode_attention_mma.usable). small_batch: the batch's kv rows are fewer than the SMs
    (decode_min_split_len's one-tile splits)."""
    if not on_gpu:
        return _CONFIGS["cpu"]
    if q_dtype == torch.float32:
        return _CONFIGS["cuda-fp32"]
    if cache_dtype in FP8_DTYPES and fp8_mma and FP8_MMA:
        return _CONFIGS["cuda-fp8-cache-mma"]
    if cache_dtype in FP8_DTYPES:
        # NOTE: the CUDA-core variants do group multiply-adds per K and V element; past 2 heads
        # per kv head the padded tensor-core dot is cheaper.
        return _CONFIGS["cuda-fp8-cache-small-group" if group <= 2 else "cuda-fp8-cache"]
    if shared_memory >= LARGE_SHARED_MEMORY and not small_batch:
        return _CONFIGS["cuda-16bit-cache-large-tiles"]
    return _CONFIGS["cuda-16bit-cache"]
