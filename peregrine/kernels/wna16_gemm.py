"""Fused dequantize-GEMM for weight-only integer weights: y (M, N) = x (M, K) @ W (K, N), with W
read as 4, 6 or 8-bit values in the layout of layers/quantization/wna16.py.

Each program dequantizes a (BLOCK_K, BLOCK_N) tile of W in registers and feeds it to tl.dot; the
weight never exists in 16 bits in memory. With contiguous groups (group size a multiple of
BLOCK_K) the zero point is subtracted from the integers and the scale is applied to the tile's
partial product, once per (row, column) rather than per weight. Small batches split K over
programs (SPLIT_K partial sums in float32, added by one torch sum) so a decode step's few rows
still spread the weight read over every SM.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from peregrine.layers.quantization.wna16 import WNA16Layout


@triton.jit
def _unpack_tile(q_ptr, qhi_ptr, offs_k, offs_n, mask, N, BITS: tl.constexpr):
    """The (BLOCK_K, BLOCK_N) tile of unsigned integer weights at rows offs_k, columns offs_n."""
    if BITS == 8:
        w = tl.load(q_ptr + (offs_k[:, None] // 4) * N + offs_n[None, :], mask=mask, other=0)
        w = (w >> ((offs_k[:, None] % 4) * 8)) & 0xFF
    else:
        w = tl.load(q_ptr + (offs_k[:, None] // 8) * N + offs_n[None, :], mask=mask, other=0)
        w = (w >> ((offs_k[:, None] % 8) * 4)) & 0xF
        if BITS == 6:
            hi = tl.load(qhi_ptr + (offs_k[:, None] // 16) * N + offs_n[None, :], mask=mask,
                         other=0)
            w = w | (((hi >> ((offs_k[:, None] % 16) * 2)) & 0x3) << 4)
    return w


@triton.jit(do_not_specialize=["M", "stride_cs"])
def _wna16_gemm_kernel(
    a_ptr, q_ptr, qhi_ptr, s_ptr, z_ptr, g_ptr, c_ptr,
    M, N, K, stride_am, stride_cs, stride_cm, K_ITERS,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am  # (BM, 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    half: tl.constexpr = 1 << (BITS - 1)
    for it in range(0, K_ITERS):
        k0 = (split * K_ITERS + it) * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)  # (BK,)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)  # (BM, BK)
        tile_mask = k_mask[:, None] & n_mask[None, :]
        w = _unpack_tile(q_ptr, qhi_ptr, offs_k, offs_n, tile_mask, N, BITS)  # (BK, BN) int32
        if HAS_GIDX:
            # NOTE: act-order: each input has its own group; gather the (BK, BN) scales.
            g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)  # (BK,)
            s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=tile_mask, other=0.0)
            if HAS_ZP:
                z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=tile_mask, other=0.0)
                wf = (w.to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)
            else:
                wf = (w - half).to(tl.float32) * s.to(tl.float32)
            if IEEE:
                acc += tl.dot(a, wf.to(a.dtype), input_precision="ieee")
            else:
                acc += tl.dot(a, wf.to(a.dtype))
        else:
            # NOTE: a split's blocks past K (K_ITERS rounded up) add nothing (a and w are
            # masked to 0) but still read a group row: clamp it to the last one, which exists,
            # since the row past the scales may not be mapped memory.
            grp = tl.minimum(k0, K - 1) // GROUP
            s = tl.load(s_ptr + grp * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)  # (BN,)
            if HAS_ZP:
                z = tl.load(z_ptr + grp * N + offs_n, mask=n_mask, other=0.0)  # (BN,)
                # NOTE: q - z is an integer in (-256, 256): exact in bf16 / fp16.
                wi = w.to(tl.float32) - z.to(tl.float32)[None, :]
            else:
                wi = (w - half).to(tl.float32)
            if IEEE:
                part = tl.dot(a, wi.to(a.dtype), input_precision="ieee")
            else:
                part = tl.dot(a, wi.to(a.dtype))
            acc += part * s[None, :]
    c = c_ptr + split * stride_cs + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int | None) -> int:
    if not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


# H100 / H200: the most shared memory one block may opt into.
_HOPPER_SMEM = 232_448
# Left free for what the estimate below does not count (a few hundred bytes of scratch).
_SMEM_MARGIN = 4 * 1024


@functools.lru_cache(maxsize=8)
def _smem_limit(device_index: int | None) -> int:
    if not torch.cuda.is_available():
        return _HOPPER_SMEM
    props = torch.cuda.get_device_properties(device_index or 0)
    return getattr(props, "shared_memory_per_block_optin", _HOPPER_SMEM)


def smem_bytes(block_m: int, block_n: int, block_k: int, stages: int, bits: int,
               a_bytes: int = 2) -> int:
    """Shared memory the GEMM needs for one config. Triton's software pipeline keeps stages - 1
    copies of each loaded tile in flight: the A tile (BM x BK activations) and the weight words
    as loaded, one int32 per value (BK x BN x 4 bytes, twice for 6 bits: the low-4 and high-2
    planes); the dot's B operand (BK x BN, the activation dtype) is staged once more, and from
    BM 64 on (Hopper's wgmma) the A operand too:
        (stages - 1) * (BM*BK*a + planes * BK*BN*4) + BK*BN*a [+ BM*BK*a]
    e.g. 6 bits, bf16, BM 32, BN 64, BK 128, 4 stages: 3 * (8 + 2 * 32) KiB + 16 KiB = 232 KiB
    = 237,568 B, over the H200's 232,448 B; 3 stages: 2 * 72 + 16 = 160 KiB. Triton's sm_90
    compiles of every config here match this to within 512 bytes."""
    planes = 2 if bits == 6 else 1
    a_tile = block_m * block_k * a_bytes
    return ((stages - 1) * (a_tile + planes * block_k * block_n * 4)
            + block_k * block_n * a_bytes + (a_tile if block_m >= 64 else 0))


def choose_config(m: int, n: int, k: int, group: int, gather: bool, num_sms: int, bits: int = 4,
                  a_bytes: int = 2, smem_limit: int = _HOPPER_SMEM) -> GemmConfig:
    """Tile sizes by batch size; split-K until the grid covers the SMs about twice; fewer
    pipeline stages (then a shorter K block) where the tile would not fit in shared memory."""
    block_k = 128
    while block_k > 16 and (k % block_k or (not gather and group % block_k)):
        block_k //= 2
    if k % block_k or (not gather and group % block_k):
        raise ValueError(f"wna16_gemm: input size {k} / group size {group} need a multiple of 16")
    if m <= 16:
        block_m, block_n, warps, stages = 16, 64, 4, 4
    elif m <= 64:
        block_m, block_n, warps, stages = 32, 64, 4, 4
    elif m <= 256:
        block_m, block_n, warps, stages = 64, 128, 4, 3
        block_k = min(block_k, 64)
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 3
        block_k = min(block_k, 64)
    budget = smem_limit - _SMEM_MARGIN
    while smem_bytes(block_m, block_n, block_k, stages, bits, a_bytes) > budget:
        if stages > 2:
            stages -= 1
        elif block_k > 16:
            block_k //= 2
        else:
            raise ValueError(f"wna16_gemm: no tile of {bits}-bit weights fits in {smem_limit} "
                             "bytes of shared memory")
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = k // block_k
    split = 1
    while tiles * split < 2 * num_sms and split * 2 <= min(16, k_blocks):
        split *= 2
    return GemmConfig(block_m, block_n, block_k, split, warps, stages)


def wna16_gemm(x: torch.Tensor, w: WNA16Layout, config: GemmConfig | None = None) -> torch.Tensor:
    """y (..., N) = x (..., K) @ dequant(w) (K, N), in x's dtype."""
    k, n = w.in_features, w.out_features
    if x.shape[-1] != k:
        raise ValueError(f"wna16_gemm: x has {x.shape[-1]} inputs, the weight {k}")
    lead = x.shape[:-1]
    a = x.reshape(-1, k)  # (M, K)
    if a.stride(-1) != 1:
        a = a.contiguous()
    m = a.shape[0]
    if config is None:
        index = x.device.index if x.is_cuda else None
        config = choose_config(m, n, k, w.group_size, w.g_idx is not None, _num_sms(index),
                               w.bits, x.element_size(), _smem_limit(index))
    bm, bn, bk, split = config.block_m, config.block_n, config.block_k, config.split_k
    if m == 0:
        return torch.empty((*lead, n), dtype=x.dtype, device=x.device)
    k_iters = triton.cdiv(triton.cdiv(k, bk), split)
    if split > 1:
        c = torch.empty((split, m, n), dtype=torch.float32, device=x.device)  # partial sums
    else:
        c = torch.empty((1, m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    q = w.qweight
    _wna16_gemm_kernel[grid](
        a, q, w.qweight_hi if w.qweight_hi is not None else q, w.scales,
        w.zeros if w.zeros is not None else w.scales, w.g_idx if w.g_idx is not None else q, c,
        m, n, k, a.stride(0), c.stride(0), c.stride(1), k_iters,
        GROUP=w.group_size, BITS=w.bits, HAS_ZP=w.zeros is not None,
        HAS_GIDX=w.g_idx is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        IEEE=x.dtype == torch.float32, num_warps=config.num_warps, num_stages=config.num_stages)
    y = c.sum(0).to(x.dtype) if split > 1 else c[0]  # (M, N)
    return y.reshape(*lead, n)
