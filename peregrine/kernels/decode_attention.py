"""Paged decode attention, split along the KV length (flash-decoding), CUDA-graph safe.

Stage 1 gives each (sequence, kv head, split) program one slice of the context; it processes all
q heads of that kv head's group together, so every K/V tile is loaded once. It writes a normalised
partial output and its log-sum-exp. Stage 2 merges the splits of each (sequence, q head).
The grid and every launch argument depend only on tensor shapes, never on seq_lens values.
"""
from __future__ import annotations

import functools
import math
import torch
import triton
import triton.language as tl

from peregrine.kernels._utils import (FP8_DTYPES, check_block_size, check_q_and_caches,
                                      check_window_and_out, dot_precision, early_step_inputs,
                                      has_fp8_convert, is_gpu, kv_dot_dtype, max_shared_memory,
                                      may_reuse_launches, next_pow2, num_sms, pdl_args,
                                      pdl_release, pdl_wait, release_before_gemv,
                                      reusable_launch)
from peregrine.kernels.decode_attention_mma import BATCH_VARYING_ARGS
from peregrine.kernels.decode_attention_mma import BLOCK_N as MMA_BLOCK_N
from peregrine.kernels.decode_attention_mma import usable as mma_fp8_unusable
from peregrine.kernels.decode_configs import PROGRAMS_PER_SM, pick_config

_reuse_launches = True  # False once a compiled launch refused its arguments

_MIN_SPLIT_LEN = 256  # tokens; shorter splits cost more in the merge than they win in parallelism
# ... unless the batch's kv rows leave SMs without a program: then one tile per split. Llama-3-8B
# batch-1 decode on an H200 (128-token tiles, 128-384 tokens of context): 393 tok/s against 384
# with int4 weights, 219.5 against 216.9 in bf16.
_SMALL_BATCH_MIN_SPLIT_LEN = 64
_MAX_SPLITS = 64
# Whether the "mma_fp8" kernel writes the output itself when a sequence has one split.
DIRECT_ONE_SPLIT = True


@functools.lru_cache(maxsize=None)
def _direct_v_scale_index() -> int:
    """Where v_scale sits among the "mma_fp8" kernel's parameters (a reused launch's list)."""
    import inspect
    from peregrine.kernels.decode_attention_mma import decode_split_mma_kernel
    return list(inspect.signature(decode_split_mma_kernel.fn).parameters).index("v_scale")


@triton.jit
def _seq_split_len(seq_len, num_splits, min_split_len, BLOCK_N: tl.constexpr):
    """Tokens per split of one sequence: its own context over the grid's split count, a whole
    number of tiles, at least min_split_len (a multiple of BLOCK_N; min_split_len >= the
    context over the split count gives every sequence that fixed length)."""
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(per_split, min_split_len)


# Variants of the split kernel (VARIANT constexpr), chosen per launch by pick_config:
#   "dot":    K loaded as (D, N), scores and P.V on tensor cores (tl.dot; the q heads of one kv
#             head are padded to 16 rows).
#   "dot_kt": K loaded as (N, D), d fastest like the cache, transposed in registers for the dot.
#   "fma":    no tl.dot: fp32 broadcast multiplies on CUDA cores, reduced over D for the scores;
#             every token row of the tile keeps its own softmax state and output rows, so the
#             loop never reduces across tokens (one reduction at the end).
#             With HEADS > 1 (kv_heads_per_program) one program reads HEADS adjacent kv heads
#             of its sequence as (BN, HEADS, BD) tiles: a token's slice of the cache is HEADS
#             times longer (FP8: 128 bytes a head at head dim 128, in rows HEADS * 128 apart).
#   "fma_fp8": (FP8 caches only) CUDA-core math on 32-bit words of four FP8 values: the tile
#             (T, ROWS, D / 4) puts d in 16-byte vectors over a few lanes, ROWS token rows over
#             the other lanes and warps and T tokens in each thread's registers. Each row keeps
#             one softmax state, so the T tokens of a thread fold into it with in-thread adds
#             and the rescale costs one multiply per row and tile, not per element; a word
#             becomes four fp32 values by two packed FP8 -> fp16 conversions (inline PTX on
#             sm_89+) and four fp16 -> fp32 moves; words carry cleanly through the prefetch.
#   "mma_fp8": (FP8 caches only, CUDA sm_89+, up to 8 q heads per kv head, head dim 64/128/256,
#             cache blocks of a multiple of 16 tokens) decode_attention_mma's Gluon kernel: one
#             warp a program, K and V words loaded straight into tensor-core operand registers.
# Options of every variant (constexpr flags; DecodeConfig):
#   PREFETCH:     the next tile's block ids, K and V are loaded before the current tile is
#                 computed (register double buffering).
#   CLAMP_TOKENS: tile tokens past the end re-read real rows instead of predicated loads.
#   ALIGNED:      tiles start on a multiple of BLOCK_N, so addresses split into a per-tile block
#                 id and a per-lane offset computed once (fewer integer ops per token).
#   ASM_CVT:      (dot variants, FP8 cache, CUDA) FP8 -> fp16 in registers by inline PTX right
#                 after the load (with PREFETCH: the prefetched tile is carried as fp16).
#                 NOTE: without it the compiler stages the FP8 tile in shared memory and reads
#                 V back byte by byte to transpose it for the dot operand. ("fma_fp8": the
#                 packed conversion instructions instead of byte shifts.)
VARIANTS = ("dot", "dot_kt", "fma", "fma_fp8", "mma_fp8")
FP8_ONLY_VARIANTS = ("fma_fp8", "mma_fp8")  # read FP8 caches only
GPU_ONLY_VARIANTS = ("mma_fp8",)  # Gluon kernels: not on the Triton interpreter
_VARIANT_IDS = {name: i for i, name in enumerate(VARIANTS)}


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, n0, end, kvh,
                  stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, VARIANT: tl.constexpr, CLAMP_TOKENS: tl.constexpr,
                  ALIGNED: tl.constexpr, ROWS: tl.constexpr, HEADS: tl.constexpr):
    """Raw K and V tiles of tokens n0 .. n0 + BLOCK_N, shaped for VARIANT: "dot" K (BD, BN),
    V (BN, BD); "dot_kt" both (BN, BD); "fma" both (1, BN, BD), with HEADS > 1 (1, BN, HEADS,
    BD) of kv heads kvh .. kvh + HEADS - 1; "fma_fp8" int32 words (_load_fp8_words). Tokens at
    or past `end` (>= 1) are zeros, or with CLAMP_TOKENS unpredicated re-reads of real cache
    rows (token end - 1, or with ALIGNED K of the last block's slots, V still zeros); the caller
    masks their scores.
    ALIGNED: n0 is a multiple of BLOCK_N, so a token's block and slot split into a per-tile
    part and a per-lane part that stays the same every tile (addresses hoisted out of the loop)."""
    if VARIANT == 3:
        k, v = _load_fp8_words(k_cache_ptr, v_cache_ptr, bt_row, n0, end, kvh, stride_kc_b,
                               stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
                               HEAD_DIM // 4, BLOCK_D // 4, BLOCK_N, ROWS, BLOCK_SIZE,
                               CLAMP_TOKENS, ALIGNED)
    elif ALIGNED:
        blk = _aligned_tile_blocks(bt_row, n0, end, BLOCK_N, BLOCK_SIZE, CLAMP_TOKENS)
        k, v = _load_aligned_tile(k_cache_ptr, v_cache_ptr, blk, n0, end, kvh,
                                  stride_kc_b, stride_kc_s, stride_kc_h,
                                  stride_vc_b, stride_vc_s, stride_vc_h,
                                  HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, VARIANT, CLAMP_TOKENS,
                                  HEADS)
    else:
        offs_n = tl.arange(0, BLOCK_N)  # (BN,)
        tok = n0 + offs_n  # (BN,)
        v_n_mask = tok < end
        if CLAMP_TOKENS:
            tok = tl.minimum(tok, end - 1)
            v_n_mask = tok >= 0  # (BN,) all true
            blk = tl.load(bt_row + tok // BLOCK_SIZE).to(tl.int64)  # (BN,)
        else:
            blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=v_n_mask,
                          other=0).to(tl.int64)  # (BN,)
        k, v = _load_kv_rows(k_cache_ptr, v_cache_ptr, blk, tok % BLOCK_SIZE, v_n_mask,
                             v_n_mask, kvh, stride_kc_b, stride_kc_s, stride_kc_h,
                             stride_vc_b, stride_vc_s, stride_vc_h, HEAD_DIM, BLOCK_D, BLOCK_N,
                             VARIANT, CLAMP_TOKENS, False, HEADS)
    return k, v


@triton.jit
def _aligned_tile_blocks(bt_row, n0, end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         CLAMP_TOKENS: tl.constexpr):
    """The cache block id (BN,) int64 of each token of the tile at n0, a multiple of BLOCK_N:
    with CLAMP_TOKENS tokens at or past `end` take the last real block, else block 0."""
    offs_n = tl.arange(0, BLOCK_N)  # (BN,)
    if BLOCK_N >= BLOCK_SIZE:
        idx = n0 // BLOCK_SIZE + offs_n // BLOCK_SIZE  # (BN,)
    else:
        idx = n0 // BLOCK_SIZE + offs_n * 0  # (BN,)
    if CLAMP_TOKENS:
        idx = tl.minimum(idx, (end - 1) // BLOCK_SIZE)
        blk = tl.load(bt_row + idx)  # (BN,)
    else:
        blk = tl.load(bt_row + idx, mask=n0 + offs_n < end, other=0)  # (BN,)
    return blk.to(tl.int64)


@triton.jit
def _load_aligned_tile(k_cache_ptr, v_cache_ptr, blk, n0, end, kvh,
                       stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s,
                       stride_vc_h, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, VARIANT: tl.constexpr,
                       CLAMP_TOKENS: tl.constexpr, HEADS: tl.constexpr):
    """_load_kv_tile's ALIGNED tiles (16-bit or FP8 elements) from the tile's block ids blk
    (_aligned_tile_blocks), so a caller may read those ahead of the tile."""
    offs_n = tl.arange(0, BLOCK_N)  # (BN,)
    v_n_mask = n0 + offs_n < end
    if BLOCK_N >= BLOCK_SIZE:
        off = offs_n % BLOCK_SIZE  # (BN,) the same every tile
    else:
        off = n0 % BLOCK_SIZE + offs_n  # (BN,)
    if CLAMP_TOKENS:
        k_n_mask = offs_n >= 0  # (BN,) all true
    else:
        k_n_mask = v_n_mask
    return _load_kv_rows(k_cache_ptr, v_cache_ptr, blk, off, k_n_mask, v_n_mask, kvh,
                         stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s,
                         stride_vc_h, HEAD_DIM, BLOCK_D, BLOCK_N, VARIANT, CLAMP_TOKENS, True,
                         HEADS)


@triton.jit
def _load_kv_rows(k_cache_ptr, v_cache_ptr, blk, off, k_n_mask, v_n_mask, kvh,
                  stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  VARIANT: tl.constexpr, CLAMP_TOKENS: tl.constexpr, ALIGNED: tl.constexpr,
                  HEADS: tl.constexpr):
    """The K and V tiles of _load_kv_tile (16-bit or FP8 elements) from each token row's cache
    block blk and slot off (BN,), K rows where k_n_mask and V rows where v_n_mask."""
    offs_d = tl.arange(0, BLOCK_D)  # (BD,)
    d_mask = offs_d < HEAD_DIM
    k_row = blk * stride_kc_b + (off * stride_kc_s + kvh * stride_kc_h)  # (BN,)
    v_row = blk * stride_vc_b + (off * stride_vc_s + kvh * stride_vc_h)  # (BN,)
    if VARIANT == 2 and HEADS > 1:
        # NOTE: d fastest, then the heads: a token's HEADS * D bytes are one contiguous run
        # of the cache, read by neighbouring lanes.
        offs_h = tl.arange(0, HEADS)[None, None, :, None]  # (1, 1, H, 1)
        d4 = offs_d[None, None, None, :]  # (1, 1, 1, BD)
        k_ptrs = k_cache_ptr + k_row[None, :, None, None] + offs_h * stride_kc_h + d4
        v_ptrs = v_cache_ptr + v_row[None, :, None, None] + offs_h * stride_vc_h + d4
        hd_mask = (offs_h >= 0) & (d4 < HEAD_DIM)  # (1, 1, H, BD)
        k_mask = k_n_mask[None, :, None, None] & hd_mask  # (1, BN, H, BD)
        v_mask = v_n_mask[None, :, None, None] & hd_mask
    elif VARIANT == 2:
        # NOTE: loaded 3-D, so the (G, N, D) products take the load's layout (d in registers
        # and a few lanes) instead of a default one that spreads d over every warp.
        k_ptrs = k_cache_ptr + k_row[None, :, None] + offs_d[None, None, :]  # (1, BN, BD)
        v_ptrs = v_cache_ptr + v_row[None, :, None] + offs_d[None, None, :]  # (1, BN, BD)
        k_mask = (k_n_mask[:, None] & d_mask[None, :])[None, :, :]
        v_mask = (v_n_mask[:, None] & d_mask[None, :])[None, :, :]
    else:
        if VARIANT == 1:
            k_ptrs = k_cache_ptr + k_row[:, None] + offs_d[None, :]  # (BN, BD)
            k_mask = k_n_mask[:, None] & d_mask[None, :]
        else:
            k_ptrs = k_cache_ptr + k_row[None, :] + offs_d[:, None]  # (BD, BN)
            k_mask = d_mask[:, None] & k_n_mask[None, :]
        v_ptrs = v_cache_ptr + v_row[:, None] + offs_d[None, :]  # (BN, BD)
        v_mask = v_n_mask[:, None] & d_mask[None, :]
    # K: no predicate at all; V: every row a real token's unless ALIGNED
    return _load_k_v(k_ptrs, k_mask, v_ptrs, v_mask, CLAMP_TOKENS and HEAD_DIM == BLOCK_D,
                     CLAMP_TOKENS and HEAD_DIM == BLOCK_D and not ALIGNED, 0.0)


@triton.jit
def _load_k_v(k_ptrs, k_mask, v_ptrs, v_mask, K_UNMASKED: tl.constexpr,
              V_UNMASKED: tl.constexpr, ZERO: tl.constexpr):
    """K and V tiles: unpredicated loads where every address is a real cache row, else masked
    loads with ZERO (0.0 for float caches, 0 for words) past the end."""
    if K_UNMASKED:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=k_mask, other=ZERO)
    if V_UNMASKED:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=v_mask, other=ZERO)
    return k, v


@triton.jit
def _fp8_to_f16(x, E5M2: tl.constexpr):
    """FP8 -> fp16, two packed hardware conversions per four elements, as an opaque step: the
    compiler keeps it where it stands (right after the load) instead of moving it past the
    layout change into shared memory, so the tile goes to shared memory as fp16 (ldmatrix),
    not as FP8 bytes read back one by one. CUDA only."""
    bits = x.to(tl.int8, bitcast=True)
    if E5M2:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 a, b; mov.b32 {a, b}, $2; "
            "cvt.rn.f16x2.e5m2x2 $0, a; cvt.rn.f16x2.e5m2x2 $1, b; }",
            "=r,=r,r", [bits], dtype=tl.float16, is_pure=False, pack=4)
    else:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 a, b; mov.b32 {a, b}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, a; cvt.rn.f16x2.e4m3x2 $1, b; }",
            "=r,=r,r", [bits], dtype=tl.float16, is_pure=False, pack=4)
    return y


@triton.jit
def _load_fp8_words(k_words_ptr, v_words_ptr, bt_row, n0, end, kvh,
                    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
                    HEAD_WORDS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, CLAMP_TOKENS: tl.constexpr,
                    ALIGNED: tl.constexpr):
    """The "fma_fp8" variant's raw K and V tiles: int32 words of four FP8 values, shaped
    (1, T, ROWS, BW) with T = BLOCK_N // ROWS, token n0 + t * ROWS + r at [0, t, r] (strides in
    words). Tokens at or past `end` (>= 1) are zeros, or with CLAMP_TOKENS unpredicated
    re-reads of token end - 1 (with ALIGNED: K of the last block's slots, V still zeros); the
    caller masks their scores. ALIGNED: n0 is a multiple of BLOCK_N, so each lane's block
    offset and slot stay the same every tile."""
    offs_t = tl.arange(0, BLOCK_N // ROWS)  # (T,)
    offs_r = tl.arange(0, ROWS)  # (R,)
    offs_w = tl.arange(0, BLOCK_W)  # (BW,)
    lane_tok = offs_t[:, None] * ROWS + offs_r[None, :]  # (T, R) the same every tile
    tok = n0 + lane_tok  # (T, R)
    n_mask = tok < end  # (T, R)
    w_mask = (offs_w < HEAD_WORDS)[None, None, None, :]  # (1, 1, 1, BW)
    v_mask = n_mask[None, :, :, None] & w_mask  # (1, T, R, BW)
    if ALIGNED:
        if BLOCK_N >= BLOCK_SIZE:
            idx = n0 // BLOCK_SIZE + lane_tok // BLOCK_SIZE  # (T, R)
            off = lane_tok % BLOCK_SIZE  # (T, R) the same every tile
        else:
            idx = n0 // BLOCK_SIZE + lane_tok * 0  # (T, R)
            off = n0 % BLOCK_SIZE + lane_tok  # (T, R)
        if CLAMP_TOKENS:
            idx = tl.minimum(idx, (end - 1) // BLOCK_SIZE)
            blk = tl.load(bt_row + idx).to(tl.int64)  # (T, R)
            k_mask = w_mask
        else:
            blk = tl.load(bt_row + idx, mask=n_mask, other=0).to(tl.int64)  # (T, R)
            k_mask = v_mask
    else:
        if CLAMP_TOKENS:
            tok = tl.minimum(tok, end - 1)
            blk = tl.load(bt_row + tok // BLOCK_SIZE).to(tl.int64)  # (T, R)
            k_mask = w_mask
            v_mask = w_mask
        else:
            blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            k_mask = v_mask
        off = tok % BLOCK_SIZE  # (T, R)
    k_row = blk * stride_kc_b + (off * stride_kc_s + kvh * stride_kc_h)  # (T, R)
    v_row = blk * stride_vc_b + (off * stride_vc_s + kvh * stride_vc_h)  # (T, R)
    k_ptrs = k_words_ptr + k_row[None, :, :, None] + offs_w[None, None, None, :]  # (1, T, R, BW)
    v_ptrs = v_words_ptr + v_row[None, :, :, None] + offs_w[None, None, None, :]  # (1, T, R, BW)
    # K: every row a real one, every word real; V: every row a real token's unless ALIGNED
    return _load_k_v(k_ptrs, k_mask, v_ptrs, v_mask, CLAMP_TOKENS and HEAD_WORDS == BLOCK_W,
                     CLAMP_TOKENS and HEAD_WORDS == BLOCK_W and not ALIGNED, 0)


@triton.jit
def _fp8_words_to_f32(w, E5M2: tl.constexpr, ASM_CVT: tl.constexpr):
    """The four fp32 values (bytes 0..3: d = 4i .. 4i + 3) of int32 words of FP8 values. With
    ASM_CVT (CUDA sm_89+): two packed FP8 -> fp16 conversions and four exact fp16 -> fp32 moves
    per word; else byte shifts and Triton's own conversion (the interpreter, older GPUs)."""
    if ASM_CVT:
        if E5M2:
            x0, x1, x2, x3 = tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi, a0, a1, b0, b1; .reg .b32 a, b; mov.b32 {lo, hi}, $4; "
                "cvt.rn.f16x2.e5m2x2 a, lo; cvt.rn.f16x2.e5m2x2 b, hi; "
                "mov.b32 {a0, a1}, a; mov.b32 {b0, b1}, b; cvt.f32.f16 $0, a0; "
                "cvt.f32.f16 $1, a1; cvt.f32.f16 $2, b0; cvt.f32.f16 $3, b1; }",
                "=r,=r,=r,=r,r", [w], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                is_pure=True, pack=1)
        else:
            x0, x1, x2, x3 = tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi, a0, a1, b0, b1; .reg .b32 a, b; mov.b32 {lo, hi}, $4; "
                "cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; "
                "mov.b32 {a0, a1}, a; mov.b32 {b0, b1}, b; cvt.f32.f16 $0, a0; "
                "cvt.f32.f16 $1, a1; cvt.f32.f16 $2, b0; cvt.f32.f16 $3, b1; }",
                "=r,=r,=r,=r,r", [w], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                is_pure=True, pack=1)
    else:
        x0 = _fp8_byte_to_f32(w & 0xFF, E5M2)
        x1 = _fp8_byte_to_f32((w >> 8) & 0xFF, E5M2)
        x2 = _fp8_byte_to_f32((w >> 16) & 0xFF, E5M2)
        x3 = _fp8_byte_to_f32((w >> 24) & 0xFF, E5M2)
    return x0, x1, x2, x3


@triton.jit
def _fp8_byte_to_f32(b, E5M2: tl.constexpr):
    """The fp32 value of FP8 bits held in the low byte of an int32."""
    if E5M2:
        x = b.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        x = b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return x


@triton.jit
def _split_fma_heads(q_ptr, k_cache_ptr, v_cache_ptr, bt_row, mid_o_ptr, mid_lse_ptr, b64, kvh,
                     split, start, lo, end, scale_log2, stride_qb, stride_qh,
                     stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
                     stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h,
                     GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, PREFETCH: tl.constexpr,
                     KV_FP8: tl.constexpr, CLAMP_TOKENS: tl.constexpr, ALIGNED: tl.constexpr):
    """The "fma" variant over kv heads kvh .. kvh + HEADS - 1 of one sequence and split (HEADS >
    1): tiles (1, BN, H, BD), every (q head, token row) its own softmax state, each q head scored
    against its own kv head's slice only; writes the same partial outputs as one head a program."""
    offs_g = tl.arange(0, BLOCK_G)  # (BG,)
    offs_h = tl.arange(0, HEADS)  # (H,)
    offs_d = tl.arange(0, BLOCK_D)  # (BD,)
    offs_n = tl.arange(0, BLOCK_N)  # (BN,)
    heads = (kvh + offs_h[None, :]) * GROUP + offs_g[:, None]  # (BG, H) q head of (g, h)
    g_mask = (offs_g < GROUP)[:, None] & (offs_h >= 0)[None, :]  # (BG, H)
    d_mask = offs_d < HEAD_DIM  # (BD,)
    q = tl.load(q_ptr + b64 * stride_qb + heads[:, :, None] * stride_qh + offs_d[None, None, :],
                mask=g_mask[:, :, None] & d_mask[None, None, :], other=0.0)  # (BG, H, BD)
    q4 = (q.to(tl.float32) * scale_log2)[:, None, :, :]  # (BG, 1, H, BD)
    # NOTE: per token row state; -1e30 (not -inf) keeps rows that saw no key free of NaN.
    m_i = tl.full([BLOCK_G, BLOCK_N, HEADS], -1.0e30, tl.float32)  # (BG, BN, H) log2 units
    l_i = tl.zeros([BLOCK_G, BLOCK_N, HEADS], tl.float32)  # (BG, BN, H)
    acc = tl.zeros([BLOCK_G, BLOCK_N, HEADS, BLOCK_D], tl.float32)  # (BG, BN, H, BD)
    if PREFETCH:
        k_raw, v_raw = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, start, end, kvh,
                                     stride_kc_b, stride_kc_s, stride_kc_h,
                                     stride_vc_b, stride_vc_s, stride_vc_h,
                                     HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, 2,
                                     CLAMP_TOKENS, ALIGNED, 1, HEADS)
    for n0 in range(start, end, BLOCK_N):
        n_mask = n0 + offs_n < end  # (BN,)
        if ALIGNED and HAS_WINDOW:
            n_mask = n_mask & (n0 + offs_n >= lo)
        if PREFETCH:
            k_cur = k_raw
            v_cur = v_raw
            k_raw, v_raw = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, n0 + BLOCK_N, end,
                                         kvh, stride_kc_b, stride_kc_s, stride_kc_h,
                                         stride_vc_b, stride_vc_s, stride_vc_h,
                                         HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, 2,
                                         CLAMP_TOKENS, ALIGNED, 1, HEADS)
        else:
            k_cur, v_cur = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, n0, end, kvh,
                                         stride_kc_b, stride_kc_s, stride_kc_h,
                                         stride_vc_b, stride_vc_s, stride_vc_h,
                                         HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, 2,
                                         CLAMP_TOKENS, ALIGNED, 1, HEADS)
        if KV_FP8:  # FP8 -> fp16 is one packed conversion per two elements, then exact fp32
            k_cur = k_cur.to(tl.float16)
            v_cur = v_cur.to(tl.float16)
        k = k_cur.to(tl.float32)  # (1, BN, H, BD)
        v = v_cur.to(tl.float32)  # (1, BN, H, BD)
        s = tl.sum(q4 * k, 3)  # (BG, BN, H)
        s = tl.where(n_mask[None, :, None], s, float("-inf"))
        m_new = tl.maximum(m_i, s)  # (BG, BN, H)
        alpha = tl.exp2(m_i - m_new)  # (BG, BN, H)
        p = tl.exp2(s - m_new)  # (BG, BN, H)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, :, :, None] + p[:, :, :, None] * v  # (BG, BN, H, BD)
        m_i = m_new
    m_row = tl.max(m_i, 1)  # (BG, H) fold the token rows: one max, one weighted sum
    w = tl.exp2(m_i - m_row[:, None, :])  # (BG, BN, H)
    l_row = tl.sum(l_i * w, 1)  # (BG, H)
    o = tl.sum(acc * w[:, :, :, None], 1)  # (BG, H, BD)
    if HAS_WINDOW:  # a split wholly before the window: zero output and weight
        o = o / tl.where(l_row > 0, l_row, 1.0)[:, :, None]
        lse = tl.where(l_row > 0, m_row + tl.log2(l_row), float("-inf"))  # (BG, H)
    else:
        o = o / l_row[:, :, None]
        lse = m_row + tl.log2(l_row)  # (BG, H)
    mo = mid_o_ptr + b64 * stride_mo_b + heads[:, :, None] * stride_mo_h + split * stride_mo_s
    tl.store(mo + offs_d[None, None, :], o, mask=g_mask[:, :, None] & d_mask[None, None, :])
    tl.store(mid_lse_ptr + b64 * stride_ml_b + heads * stride_ml_h + split, lse, mask=g_mask)


# NOTE: ints that change with the batch are not specialised on (BATCH_VARYING_ARGS). The merge's
# BLOCK_S variants are compiled by precompile().
@triton.jit(do_not_specialize=BATCH_VARYING_ARGS)
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    scale_log2, min_split_len, window,
    stride_qb, stride_qh,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    stride_bt,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, HAS_WINDOW: tl.constexpr,
    CLAMP_Q: tl.constexpr, VARIANT: tl.constexpr, PREFETCH: tl.constexpr, KV_FP8: tl.constexpr,
    CLAMP_TOKENS: tl.constexpr, ALIGNED: tl.constexpr, ASM_CVT: tl.constexpr,
    KV_E5M2: tl.constexpr, HEADS_FIRST: tl.constexpr, ROWS: tl.constexpr,
    HEADS: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr = False,
):
    if not EARLY:
        pdl_wait(PDL)
    if HEADS_FIRST:  # grid (Hkv / HEADS, B, S): the kv heads of one sequence run side by side
        kvh = tl.program_id(0) * HEADS
        b = tl.program_id(1)
    else:  # grid (B, Hkv / HEADS, S)
        b = tl.program_id(0)
        kvh = tl.program_id(1) * HEADS
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = _seq_split_len(seq_len, tl.num_programs(2), min_split_len, BLOCK_N)
    start = split * split_len
    if start >= seq_len:  # NOTE: splits past the context exit; the merge derives how many ran
        return
    end = tl.minimum(start + split_len, seq_len)
    if HAS_WINDOW:  # the query at seq_len - 1 sees keys seq_len - window .. seq_len - 1
        start = tl.maximum(start, seq_len - window)
    lo = start  # the first key this program attends to
    if ALIGNED:  # tiles start on a multiple of BLOCK_N; keys before lo are masked
        start = start - start % BLOCK_N
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    # NOTE: with EARLY the sequence length and the first tile's block ids (step inputs) are read
    # before the wait; then each tile's block ids are read a tile ahead.
    BLOCKS_AHEAD: tl.constexpr = EARLY and ALIGNED and not PREFETCH and VARIANT < 3 and HEADS == 1
    if BLOCKS_AHEAD:
        blk_next = _aligned_tile_blocks(bt_row, start, end, BLOCK_N, BLOCK_SIZE, CLAMP_TOKENS)
    if EARLY:
        pdl_wait(PDL)
    if HEADS > 1:  # ("fma" only) HEADS adjacent kv heads, the first is kvh
        _split_fma_heads(q_ptr, k_cache_ptr, v_cache_ptr, bt_row, mid_o_ptr, mid_lse_ptr,
                         b.to(tl.int64), kvh, split, start, lo, end, scale_log2, stride_qb,
                         stride_qh,
                         stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s,
                         stride_vc_h, stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b,
                         stride_ml_h, GROUP, HEADS, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N,
                         BLOCK_SIZE, HAS_WINDOW, PREFETCH, KV_FP8, CLAMP_TOKENS, ALIGNED)
        return

    offs_g = tl.arange(0, BLOCK_G)  # (BG,)
    offs_d = tl.arange(0, BLOCK_D)  # (BD,)
    offs_n = tl.arange(0, BLOCK_N)  # (BN,)
    heads = kvh * GROUP + offs_g  # (BG,)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    b64 = b.to(tl.int64)
    if VARIANT == 3:  # q as four (BG, 1, 1, BW) slices: d = 4 * word + j for j = 0 .. 3
        offs_w = tl.arange(0, BLOCK_D // 4)  # (BW,)
        q_w = (q_ptr + b64 * stride_qb + heads[:, None, None, None] * stride_qh
               + 4 * offs_w[None, None, None, :])  # (BG, 1, 1, BW)
        q_w_mask = g_mask[:, None, None, None] & (4 * offs_w < HEAD_DIM)[None, None, None, :]
        q0 = tl.load(q_w, mask=q_w_mask, other=0.0).to(tl.float32) * scale_log2
        q1 = tl.load(q_w + 1, mask=q_w_mask, other=0.0).to(tl.float32) * scale_log2
        q2 = tl.load(q_w + 2, mask=q_w_mask, other=0.0).to(tl.float32) * scale_log2
        q3 = tl.load(q_w + 3, mask=q_w_mask, other=0.0).to(tl.float32) * scale_log2
    else:
        q = tl.load(q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # (BG, BD)
    if VARIANT == 2:
        q3 = (q * scale_log2)[:, None, :]  # (BG, 1, BD) fp32 throughout: the scale folds in once
    elif VARIANT != 3:
        if CLAMP_Q:  # a bf16 query cast to fp16 for an FP8 cache (kv_dot_dtype)
            q = tl.minimum(tl.maximum(q, -65504.0), 65504.0)
        q = q.to(DOT_DTYPE)

    if VARIANT == 2:
        # NOTE: per token row state; -1e30 (not -inf) keeps rows that saw no key free of NaN.
        m_i = tl.full([BLOCK_G, BLOCK_N], -1.0e30, tl.float32)  # (BG, BN) log2 units
        l_i = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)  # (BG, BN)
        acc = tl.zeros([BLOCK_G, BLOCK_N, BLOCK_D], tl.float32)  # (BG, BN, BD)
    elif VARIANT == 3:  # one state per token row r; acc_j holds d = 4 * word + j
        offs_tr = (tl.arange(0, BLOCK_N // ROWS)[:, None] * ROWS
                   + tl.arange(0, ROWS)[None, :])[None, :, :, None]  # (1, T, R, 1)
        m_i = tl.full([BLOCK_G, 1, ROWS, 1], -1.0e30, tl.float32)  # (BG, 1, R, 1) log2 units
        l_i = tl.zeros([BLOCK_G, 1, ROWS, 1], tl.float32)  # (BG, 1, R, 1)
        acc0 = tl.zeros([BLOCK_G, 1, ROWS, BLOCK_D // 4], tl.float32)  # (BG, 1, R, BW)
        acc1 = tl.zeros([BLOCK_G, 1, ROWS, BLOCK_D // 4], tl.float32)
        acc2 = tl.zeros([BLOCK_G, 1, ROWS, BLOCK_D // 4], tl.float32)
        acc3 = tl.zeros([BLOCK_G, 1, ROWS, BLOCK_D // 4], tl.float32)
    else:
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # (BG,) running max, log2 units
        l_i = tl.zeros([BLOCK_G], tl.float32)  # (BG,) running sum
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)  # (BG, BD)
    if PREFETCH:
        k_raw, v_raw = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, start, end, kvh,
                                     stride_kc_b, stride_kc_s, stride_kc_h,
                                     stride_vc_b, stride_vc_s, stride_vc_h,
                                     HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, VARIANT,
                                     CLAMP_TOKENS, ALIGNED, ROWS, 1)
        if ASM_CVT and VARIANT < 2:  # NOTE: carried as fp16, not as FP8 bytes (see below)
            k_raw = _fp8_to_f16(k_raw, KV_E5M2)
            v_raw = _fp8_to_f16(v_raw, KV_E5M2)
    for n0 in range(start, end, BLOCK_N):
        n_mask = n0 + offs_n < end  # (BN,)
        if ALIGNED and HAS_WINDOW:
            n_mask = n_mask & (n0 + offs_n >= lo)
        if PREFETCH:
            k_cur = k_raw
            v_cur = v_raw
            k_raw, v_raw = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, n0 + BLOCK_N, end,
                                         kvh, stride_kc_b, stride_kc_s, stride_kc_h,
                                         stride_vc_b, stride_vc_s, stride_vc_h,
                                         HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, VARIANT,
                                         CLAMP_TOKENS, ALIGNED, ROWS, 1)
            if ASM_CVT and VARIANT < 2:
                # NOTE: FP8 tiles carried across iterations sit one byte per register and cost
                # byte shuffles; converted right after the load they carry as packed fp16.
                k_raw = _fp8_to_f16(k_raw, KV_E5M2)
                v_raw = _fp8_to_f16(v_raw, KV_E5M2)
        elif BLOCKS_AHEAD:
            blk = blk_next
            blk_next = _aligned_tile_blocks(bt_row, n0 + BLOCK_N, end, BLOCK_N, BLOCK_SIZE,
                                            CLAMP_TOKENS)
            k_cur, v_cur = _load_aligned_tile(k_cache_ptr, v_cache_ptr, blk, n0, end, kvh,
                                              stride_kc_b, stride_kc_s, stride_kc_h,
                                              stride_vc_b, stride_vc_s, stride_vc_h,
                                              HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, VARIANT,
                                              CLAMP_TOKENS, 1)
        else:
            k_cur, v_cur = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, n0, end, kvh,
                                         stride_kc_b, stride_kc_s, stride_kc_h,
                                         stride_vc_b, stride_vc_s, stride_vc_h,
                                         HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, VARIANT,
                                         CLAMP_TOKENS, ALIGNED, ROWS, 1)
        # NOTE: the K scale is inside scale_log2 and the V scale is applied by the merge, so an
        # FP8 tile costs one conversion per element here and nothing more.
        if VARIANT == 3:
            k0, k1, k2, k3 = _fp8_words_to_f32(k_cur, KV_E5M2, ASM_CVT)  # (1, T, R, BW) each
            s = tl.sum(q0 * k0 + q1 * k1 + q2 * k2 + q3 * k3, 3, keep_dims=True)  # (BG, T, R, 1)
            tok = n0 + offs_tr  # (1, T, R, 1)
            t_mask = tok < end
            if ALIGNED and HAS_WINDOW:
                t_mask = t_mask & (tok >= lo)
            s = tl.where(t_mask, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1, keep_dims=True))  # (BG, 1, R, 1)
            alpha = tl.exp2(m_i - m_new)  # (BG, 1, R, 1)
            p = tl.exp2(s - m_new)  # (BG, T, R, 1)
            l_i = l_i * alpha + tl.sum(p, 1, keep_dims=True)
            v0, v1, v2, v3 = _fp8_words_to_f32(v_cur, KV_E5M2, ASM_CVT)  # (1, T, R, BW) each
            # NOTE: the T tokens of a row sit in one thread: these sums are in-register adds.
            acc0 = acc0 * alpha + tl.sum(p * v0, 1, keep_dims=True)  # (BG, 1, R, BW)
            acc1 = acc1 * alpha + tl.sum(p * v1, 1, keep_dims=True)
            acc2 = acc2 * alpha + tl.sum(p * v2, 1, keep_dims=True)
            acc3 = acc3 * alpha + tl.sum(p * v3, 1, keep_dims=True)
            m_i = m_new
        elif VARIANT == 2:
            if KV_FP8:  # FP8 -> fp16 is one packed conversion per two elements, then exact fp32
                k_cur = k_cur.to(tl.float16)
                v_cur = v_cur.to(tl.float16)
            k = k_cur.to(tl.float32)  # (1, BN, BD)
            v = v_cur.to(tl.float32)  # (1, BN, BD)
            s = tl.sum(q3 * k, 2)  # (BG, BN)
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, s)  # (BG, BN)
            alpha = tl.exp2(m_i - m_new)  # (BG, BN)
            p = tl.exp2(s - m_new)  # (BG, BN)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, :, None] + p[:, :, None] * v  # (BG, BN, BD)
            m_i = m_new
        else:
            if ASM_CVT and not PREFETCH:  # (prefetched tiles were converted on load)
                k_cur = _fp8_to_f16(k_cur, KV_E5M2)
                v_cur = _fp8_to_f16(v_cur, KV_E5M2)
            if VARIANT == 1:
                k_t = tl.trans(k_cur.to(DOT_DTYPE))  # (BD, BN)
            else:
                k_t = k_cur.to(DOT_DTYPE)  # (BD, BN)
            s = tl.dot(q, k_t, input_precision=DOT_PREC) * scale_log2  # (BG, BN)
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # (BG,)
            alpha = tl.exp2(m_i - m_new)  # (BG,)
            p = tl.exp2(s - m_new[:, None])  # (BG, BN)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v_cur.to(DOT_DTYPE),
                                                input_precision=DOT_PREC)  # (BG, BD)
            m_i = m_new

    if VARIANT == 3:  # fold the rows, then store d = 4 * word + j from acc_j
        m_row = tl.max(m_i, 2, keep_dims=True)  # (BG, 1, 1, 1)
        w = tl.exp2(m_i - m_row)  # (BG, 1, R, 1)
        l_row = tl.sum(l_i * w, 2, keep_dims=True)  # (BG, 1, 1, 1)
        if HAS_WINDOW:  # a split wholly before the window: zero output and weight
            inv = 1.0 / tl.where(l_row > 0, l_row, 1.0)
            lse = tl.where(l_row > 0, m_row + tl.log2(l_row), float("-inf"))  # (BG, 1, 1, 1)
        else:
            inv = 1.0 / l_row
            lse = m_row + tl.log2(l_row)  # (BG, 1, 1, 1)
        g4 = heads[:, None, None, None]  # (BG, 1, 1, 1)
        mo = (mid_o_ptr + b64 * stride_mo_b + g4 * stride_mo_h + split * stride_mo_s
              + 4 * offs_w[None, None, None, :])  # (BG, 1, 1, BW)
        o_mask = g_mask[:, None, None, None] & (4 * offs_w < HEAD_DIM)[None, None, None, :]
        tl.store(mo, tl.sum(acc0 * w, 2, keep_dims=True) * inv, mask=o_mask)
        tl.store(mo + 1, tl.sum(acc1 * w, 2, keep_dims=True) * inv, mask=o_mask)
        tl.store(mo + 2, tl.sum(acc2 * w, 2, keep_dims=True) * inv, mask=o_mask)
        tl.store(mo + 3, tl.sum(acc3 * w, 2, keep_dims=True) * inv, mask=o_mask)
        tl.store(mid_lse_ptr + b64 * stride_ml_b + g4 * stride_ml_h + split, lse,
                 mask=g_mask[:, None, None, None])
    else:
        if VARIANT == 2:  # fold the token rows: one max, one weighted sum
            m_row = tl.max(m_i, 1)  # (BG,)
            w = tl.exp2(m_i - m_row[:, None])  # (BG, BN)
            l_i = tl.sum(l_i * w, 1)  # (BG,)
            acc = tl.sum(acc * w[:, :, None], 1)  # (BG, BD)
            m_i = m_row
        if HAS_WINDOW:
            # NOTE: a split wholly before the window saw no key: zero output and weight in the
            # merge.
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (BG, BD)
            lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))  # (BG,)
        else:
            out = acc / l_i[:, None]  # (BG, BD)
            lse = m_i + tl.log2(l_i)  # (BG,)
        mo = mid_o_ptr + b64 * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s
        tl.store(mo + offs_d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
        tl.store(mid_lse_ptr + b64 * stride_ml_b + heads * stride_ml_h + split, lse, mask=g_mask)


@triton.jit(do_not_specialize=["grid_splits", "min_split_len", "stride_mo_b", "stride_mo_h",
                               "stride_ml_b", "stride_ml_h"])
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, seq_lens_ptr, o_ptr, grid_splits, min_split_len, v_scale,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr, RELEASE: tl.constexpr = False, EARLY: tl.constexpr = False,
):
    pdl_release(RELEASE)
    if not EARLY:
        pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    b64 = b.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)  # a step input: with EARLY read before the wait
    split_len = _seq_split_len(seq_len, grid_splits, min_split_len, BLOCK_N)
    num_splits = tl.cdiv(seq_len, split_len)  # splits that ran (0 for an empty seq)
    if EARLY:
        pdl_wait(PDL)
    offs_s = tl.arange(0, BLOCK_S)  # (BS,)
    offs_d = tl.arange(0, BLOCK_D)  # (BD,)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + b64 * stride_ml_b + h * stride_ml_h + offs_s,
                  mask=s_mask, other=float("-inf"))  # (BS,)
    m = tl.max(lse, 0)
    m = tl.where(num_splits > 0, m, 0.0)  # NOTE: keeps an empty (padding) sequence free of NaN
    w = tl.exp2(lse - m)  # (BS,), 0 for splits that did not run
    o = tl.load(mid_o_ptr + b64 * stride_mo_b + h * stride_mo_h + offs_s[:, None] * stride_mo_s
                + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # (BS, BD)
    denom = tl.sum(w, 0)
    acc = tl.sum(w[:, None] * o, 0)  # (BD,)
    out = acc / tl.where(denom > 0, denom, 1.0) * v_scale  # the cache holds v / v_scale
    tl.store(o_ptr + b64 * stride_ob + h * stride_oh + offs_d,
             out.to(o_ptr.dtype.element_ty), mask=d_mask)


def _small_batch(batch: int, num_kv_rows: int, device: torch.device) -> bool:
    """Whether the batch's kv rows are fewer than the SMs (short splits, pick_config's
    small_batch)."""
    return batch * num_kv_rows < num_sms(device)


def decode_min_split_len(batch: int, num_kv_rows: int, device: torch.device) -> int:
    """The fewest tokens a split takes (rounded up to whole tiles by the launcher), from shapes
    only: _MIN_SPLIT_LEN, or one tile where the batch's kv rows are fewer than the SMs."""
    if _small_batch(batch, num_kv_rows, device):
        return _SMALL_BATCH_MIN_SPLIT_LEN
    return _MIN_SPLIT_LEN


def decode_num_splits(batch: int, num_kv_rows: int, max_blocks: int, block_size: int,
                      device: torch.device, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Splits per (sequence, kv-head row), from shapes only: enough programs to fill the GPU, at
    most as many as the block table's width holds splits of decode_min_split_len. Each sequence
    divides its own context into that many splits (of at least that many tokens), so sequences
    much shorter than the table still use them all."""
    want = math.ceil(programs_per_sm * num_sms(device) / max(1, batch * num_kv_rows))
    shortest = decode_min_split_len(batch, num_kv_rows, device)
    return max(1, min(want, _MAX_SPLITS, math.ceil(max_blocks * block_size / shortest)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, *, split_len: int | None = None,
                           num_splits: int | None = None, min_split_len: int | None = None,
                           block_n: int | None = None, window: int | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0, num_warps: int | None = None,
                           num_stages: int | None = None, variant: str | None = None,
                           prefetch: bool | None = None,
                           clamp_tokens: bool | None = None,
                           aligned: bool | None = None,
                           asm_cvt: bool | None = None,
                           heads_first: bool | None = None,
                           kv_heads_per_program: int | None = None,
                           early_inputs: bool | None = None,
                           launches: dict | None = None) -> torch.Tensor:
    """Attention of one query token per sequence, q (B, Hq, D), over its whole paged context of
    seq_lens[b] <= block_table.shape[1] * block_size tokens (only the last `window` tokens with a
    sliding window); returns out (B, Hq, D). A sequence with seq_len 0 (CUDA-graph padding)
    gets zeros. The caches hold k / k_scale and v / v_scale (any float type, FP8 included).
    By default each sequence splits its own context into num_splits pieces (decode_num_splits
    from the shapes) of at least min_split_len tokens (default _MIN_SPLIT_LEN); split_len
    instead gives every sequence splits of exactly that many tokens.
    variant, block_n, num_warps, num_stages, prefetch, clamp_tokens, aligned, asm_cvt,
    heads_first, kv_heads_per_program override pick_config's choice (DecodeConfig says what each
    does). early_inputs: the split kernel reads the sequence lengths and its first tile's block
    ids before its dependent-launch wait, then each tile's block ids a tile ahead ("dot", "dot_kt"
    and "fma" with ALIGNED and without PREFETCH; the Triton kernel's other forms move only the
    lengths, "mma_fp8" nothing), and the merge its sequence lengths (default: with dependent
    launches, where the batch's kv rows are fewer than the SMs; _utils.EARLY_STEP_INPUTS).

    launches: a dict that lives as long as one step's metadata (as in extend_attention): the
    first call of a step keeps its two compiled launches (and its scratch buffers) there, and
    the next layers' calls, which differ only in their caches and scales, launch them again."""
    global _reuse_launches
    key = None
    if launches is not None and out is not None and _reuse_launches:
        key = ("decode", q.data_ptr(), q.shape, q.dtype, out.data_ptr(), block_table.data_ptr(),
               block_table.shape, seq_lens.data_ptr(), k_cache.shape, k_cache.dtype,
               k_cache.stride(), v_cache.stride(), k_cache.data_ptr() % 16 == 0,
               v_cache.data_ptr() % 16 == 0, scale, window, split_len, num_splits, min_split_len,
               block_n, num_warps, num_stages, variant, prefetch, clamp_tokens, aligned, asm_cvt,
               heads_first, kv_heads_per_program, early_inputs)
        hit = launches.get(key)
        if hit is not None:
            (split, split_args), merge_launch, as_words = hit
            k_arg, v_arg = ((k_cache.view(torch.int32), v_cache.view(torch.int32)) if as_words
                            else (k_cache, v_cache))
            split_args[1], split_args[2] = k_arg, v_arg
            split_args[7] = scale * k_scale * math.log2(math.e)
            if merge_launch is None:  # the split kernel wrote the output (see DIRECT below)
                split_args[_direct_v_scale_index()] = v_scale
            else:
                merge_launch[1][6] = v_scale
            try:
                split(*split_args)
                if merge_launch is not None:
                    merge_launch[0](*merge_launch[1])
                return out
            except TypeError:
                # NOTE: a Triton whose compiled launcher takes other arguments refuses them
                # before launching anything: launch through the JIT from now on.
                _reuse_launches = False
                launches.clear()
                key = None
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = check_q_and_caches(q, k_cache, v_cache)
    if block_table.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"block_table {tuple(block_table.shape)} / seq_lens "
                         f"{tuple(seq_lens.shape)} do not match batch {batch}")
    check_block_size(block_size)
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"paged_decode_attention: unknown variant {variant!r} "
                         f"(expected one of {VARIANTS})")
    out = check_window_and_out("paged_decode_attention", q, out, k_cache, v_cache,
                               window)  # (B, Hq, D)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    small_batch = _small_batch(batch, num_kv_heads, q.device)
    cfg = pick_config(q.dtype, k_cache.dtype, group, is_gpu(q), max_shared_memory(q.device),
                      fp8_mma=mma_fp8_unusable(q, k_cache, group, block_size) is None,
                      small_batch=small_batch)
    variant = variant or cfg.variant
    if variant == "mma_fp8":
        why = mma_fp8_unusable(q, k_cache, group, block_size)
        if why is not None:
            raise ValueError(f"paged_decode_attention: variant 'mma_fp8' needs {why}")
        if block_n not in (None, MMA_BLOCK_N) or num_warps not in (None, 1):
            raise ValueError(f"paged_decode_attention: variant 'mma_fp8' runs one warp over "
                             f"{MMA_BLOCK_N}-token tiles, got block_n {block_n}, num_warps "
                             f"{num_warps}")
        block_n, num_warps = MMA_BLOCK_N, 1
    block_n = block_n or cfg.block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    per_program = cfg.kv_heads_per_program if kv_heads_per_program is None \
        else kv_heads_per_program
    check_kv_heads_per_program(per_program, num_kv_heads, variant)
    table_tokens = block_table.shape[1] * block_size
    if split_len is not None:  # fixed splits: min_split_len covers every sequence's share
        if num_splits is not None or min_split_len is not None:
            raise ValueError("paged_decode_attention: split_len fixes the splits; do not also "
                             "pass num_splits or min_split_len")
        if split_len <= 0 or split_len % block_n:
            raise ValueError(f"split_len {split_len} must be a positive multiple of block_n "
                             f"{block_n}")
        num_splits, min_split_len = max(1, math.ceil(table_tokens / split_len)), split_len
    else:
        if num_splits is None:  # NOTE: programs per SM counts programs: fewer kv rows, more splits
            num_splits = decode_num_splits(batch, num_kv_heads // per_program,
                                           block_table.shape[1], block_size, q.device,
                                           cfg.programs_per_sm)
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        if min_split_len is None:
            min_split_len = decode_min_split_len(batch, num_kv_heads // per_program, q.device)
        if min_split_len <= 0:
            raise ValueError(f"min_split_len must be >= 1, got {min_split_len}")
        min_split_len = -(-min_split_len // block_n) * block_n  # whole tiles
    mid_o = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32,
                        device=q.device)  # (B, Hq, S, D)
    mid_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32,
                          device=q.device)  # (B, Hq, S)
    block_d = max(16, next_pow2(head_dim))
    num_warps = num_warps or cfg.num_warps
    dot_type, clamp_q = kv_dot_dtype(q, k_cache)
    kv_fp8 = k_cache.dtype in FP8_DTYPES
    # NOTE: tl.dot needs 16 rows; the CUDA-core variants compute only the real q heads.
    block_g = next_pow2(group) if variant in ("fma", "fma_fp8") else max(16, next_pow2(group))
    k_arg, v_arg, rows = k_cache, v_cache, 1
    if variant in ("fma_fp8", "mma_fp8"):
        if not kv_fp8 or head_dim % 4:
            raise ValueError(f"paged_decode_attention: variant {variant!r} reads FP8 caches with "
                             f"a head dim divisible by 4, got {k_cache.dtype} and {head_dim}")
        try:  # the caches as int32 words of four FP8 values (strides in words)
            k_arg, v_arg = k_cache.view(torch.int32), v_cache.view(torch.int32)
        except RuntimeError as e:
            raise ValueError(f"paged_decode_attention: variant {variant!r} reads the caches as "
                             f"32-bit words, which their layout does not allow: {e}") from e
        # NOTE: the word tile's load layout: 16-byte vectors, block_d / 16 lanes along d, the
        # other lanes and the warps along token rows; more rows than tile tokens only repeat.
        rows = min(block_n, 32 // min(32, block_d // 16) * num_warps)
    heads_first = cfg.heads_first if heads_first is None else heads_first
    kv_rows = num_kv_heads // per_program
    grid = (kv_rows, batch, num_splits) if heads_first else (batch, kv_rows, num_splits)
    split_args = (
        q, k_arg, v_arg, block_table, seq_lens, mid_o, mid_lse,
        scale * k_scale * math.log2(math.e), min_split_len, window or 0,
        q.stride(0), q.stride(1),
        k_arg.stride(0), k_arg.stride(1), k_arg.stride(2),
        v_arg.stride(0), v_arg.stride(1), v_arg.stride(2),
        block_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
    )
    split_kernel = _decode_split_kernel
    split_kwargs = dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=block_g, BLOCK_D=block_d,
        BLOCK_N=block_n, BLOCK_SIZE=block_size,
        DOT_DTYPE=dot_type, DOT_PREC=dot_precision(q), HAS_WINDOW=window is not None,
        CLAMP_Q=clamp_q, VARIANT=_VARIANT_IDS[variant],
        PREFETCH=cfg.prefetch if prefetch is None else prefetch,
        KV_FP8=kv_fp8,
        CLAMP_TOKENS=cfg.clamp_tokens if clamp_tokens is None else clamp_tokens,
        ALIGNED=cfg.aligned if aligned is None else aligned,
        ASM_CVT=(cfg.asm_cvt if asm_cvt is None else asm_cvt) and kv_fp8 and variant != "fma"
        and has_fp8_convert(q.device),
        KV_E5M2=k_cache.dtype == torch.float8_e5m2,
        HEADS_FIRST=heads_first, ROWS=rows, HEADS=per_program,
    )
    # NOTE: with one split per sequence the "mma_fp8" kernel writes the output itself (V scale
    # applied, an empty sequence's rows zeroed) and no merge runs.
    direct = variant == "mma_fp8" and num_splits == 1 and DIRECT_ONE_SPLIT
    if variant == "mma_fp8":  # the same grid and leading arguments; its own constexprs
        from peregrine.kernels.decode_attention_mma import decode_split_mma_kernel
        split_kernel = decode_split_mma_kernel
        split_args += (out, v_scale, out.stride(0), out.stride(1))
        split_kwargs = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_N=block_n,
                            BLOCK_SIZE=block_size, HAS_WINDOW=window is not None,
                            HEADS_FIRST=heads_first, KV_E5M2=split_kwargs["KV_E5M2"],
                            PREFETCH=split_kwargs["PREFETCH"],
                            STAGES=num_stages or cfg.num_stages, DIRECT=direct)
    pdl = pdl_args(q)
    launch_pdl = {"launch_pdl": True} if pdl["PDL"] else {}
    split_kwargs["PDL"] = pdl["PDL"]
    if early_inputs is None:
        early_inputs = early_step_inputs(pdl) and small_batch
    if variant != "mma_fp8":
        split_kwargs["EARLY"] = bool(early_inputs)
    split_options = dict(num_warps=num_warps, num_stages=num_stages or cfg.num_stages,
                         **launch_pdl)
    merge_args = (
        mid_o, mid_lse, seq_lens, out, num_splits, min_split_len, v_scale,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
    )
    merge_kwargs = dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_pow2(num_splits), BLOCK_N=block_n,
        PDL=pdl["PDL"], RELEASE=release_before_gemv(pdl, batch), EARLY=bool(early_inputs),
    )
    merge_options = dict(num_warps=4, **launch_pdl)
    reuse = key is not None and may_reuse_launches(q)
    if not reuse:
        split_kernel[grid](*split_args, **split_kwargs, **split_options)
        if not direct:
            _decode_merge_kernel[(batch, num_q_heads)](*merge_args, **merge_kwargs,
                                                       **merge_options)
        return out
    split = reusable_launch(split_kernel, grid, split_args, split_kwargs, split_options)
    merge = None if direct else reusable_launch(_decode_merge_kernel, (batch, num_q_heads),
                                                merge_args, merge_kwargs, merge_options)
    if split is not None and (direct or merge is not None):
        launches[key] = (split, merge, variant in ("fma_fp8", "mma_fp8"))
    return out


def check_kv_heads_per_program(per_program: int, num_kv_heads: int, variant: str) -> None:
    """Refuse a kv_heads_per_program the split kernel cannot run: a power of two dividing the
    kv head count, above 1 only for the "fma" variant."""
    if (not isinstance(per_program, int) or isinstance(per_program, bool) or per_program < 1
            or per_program & (per_program - 1)):
        raise ValueError(f"paged_decode_attention: kv_heads_per_program must be a power of two "
                         f">= 1, got {per_program!r}")
    if num_kv_heads % per_program:
        raise ValueError(f"paged_decode_attention: kv_heads_per_program {per_program} does not "
                         f"divide the {num_kv_heads} kv heads")
    if per_program > 1 and variant != "fma":
        raise ValueError(f"paged_decode_attention: kv_heads_per_program {per_program} needs the "
                         f"'fma' variant, got {variant!r}")


def max_decode_splits(max_context: int) -> int:
    """The most splits decode_num_splits gives a block table of max_context tokens (or fewer),
    at any batch size."""
    return max(1, min(_MAX_SPLITS, math.ceil(max_context / _SMALL_BATCH_MIN_SPLIT_LEN)))


def precompile(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype, device: torch.device,
               cache_dtype: torch.dtype | None = None, max_context: int | None = None) -> None:
    """Compile the split kernels pick_config chooses for this model (at batches whose kv rows
    are fewer than the SMs and at the others) and every merge variant (one per power-of-two
    split count) now, so that no batch size met later compiles one on the request path.
    dtype: q's; cache_dtype: the KV cache's (default: dtype); max_context: the widest block
    table in tokens (default: any), which bounds the split counts a decode can use (a
    512-token model needs 2 of the 7 variants)."""
    # NOTE: decode_num_splits never gives a table of max_context tokens more than
    # max_decode_splits(max_context) splits, so the merge's BLOCK_S stays below its next power
    # of two; a caller passing split_len itself may go further and compile on first use.
    limit = _MAX_SPLITS if max_context is None else next_pow2(max_decode_splits(max_context))
    cache = torch.zeros(1, block_size, num_kv_heads, head_dim, dtype=cache_dtype or dtype,
                        device=device)
    group = num_q_heads // num_kv_heads
    # a batch for each config: kv rows fewer than the SMs (1 sequence) and as many or more
    # (pick_config's small_batch), the second only where its config differs
    configs = {}
    for batch in (1, -(-num_sms(device) // num_kv_heads)):
        q = torch.zeros(batch, num_q_heads, head_dim, dtype=dtype, device=device)
        cfg = pick_config(dtype, cache.dtype, group, is_gpu(q), max_shared_memory(q.device),
                          fp8_mma=mma_fp8_unusable(q, cache, group, block_size) is None,
                          small_batch=_small_batch(batch, num_kv_heads, device))
        configs.setdefault(cfg, q)
    for cfg, q in configs.items():
        batch, block_n = q.shape[0], cfg.block_n
        seq_lens = torch.ones(batch, dtype=torch.int32, device=device)
        splits = 1
        while splits <= limit:  # splits of block_n tokens over a table of splits * block_n
            table = torch.zeros(batch, -(-splits * block_n // block_size), dtype=torch.int32,
                                device=device)
            paged_decode_attention(q, cache, cache, table, seq_lens, 1.0, split_len=block_n)
            splits *= 2
