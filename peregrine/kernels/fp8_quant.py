"""W8A8 kernels: dynamic per-token(-group) activation quantization to FP8 / INT8 (Triton) and a
block-scaled FP8 GEMM (Triton, DeepSeek-style 128x128 weight blocks), each with a torch reference.

Scales are dequantization multipliers everywhere: x ~= q * scale.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
INT8_MAX = 127.0
# NOTE: a floor on the scale keeps an all-zero row finite (q = 0, scale = tiny).
_MIN_SCALE = 1e-12


def _qmax(dtype: torch.dtype) -> float:
    if dtype == FP8_DTYPE:
        return FP8_MAX
    if dtype == torch.int8:
        return INT8_MAX
    raise ValueError(f"activation quantization to {dtype} is not supported (float8_e4m3fn, int8)")


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero (what the Triton kernel does for INT8)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q = x / scale (broadcast), rounded and saturated into `dtype` (float8_e4m3fn or int8)."""
    qmax = _qmax(dtype)
    q = (x.float() / scale).clamp(-qmax, qmax)
    return (round_half_away(q) if dtype == torch.int8 else q).to(dtype)


def per_token_group_quant_ref(x: torch.Tensor, dtype: torch.dtype,
                              group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: x (M, K) -> q (M, K) in dtype, scale (M, ceil(K / group)) fp32 (group None: K)."""
    m, k = x.shape
    group = group or k
    ng = triton.cdiv(k, group)
    xf = torch.nn.functional.pad(x.float(), (0, ng * group - k)).view(m, ng, group)
    # NOTE: scale = amax * fp32(1 / qmax), computed the same way by the kernel, so both round
    # identically: one ulp of scale moves near-tie quotients, and an FP8 step near the top of the
    # range is 1/16 of the value.
    scale = (xf.abs().amax(-1) * (1.0 / _qmax(dtype))).clamp(min=_MIN_SCALE)  # (M, ng)
    q = quantize_with_scale(xf, scale[..., None], dtype).view(m, ng * group)[:, :k]
    return q.contiguous(), scale


@triton.jit(do_not_specialize=["M", "K", "stride_x", "stride_q"])
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, num_groups, qmax, inv_qmax,
                        GROUP: tl.constexpr, BLOCK: tl.constexpr, IS_INT: tl.constexpr):
    row = tl.program_id(0)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (offs < K)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    # NOTE: div_rn is IEEE division, as torch's tensor / tensor; the default fp32 division on
    # NVIDIA GPUs is approximate (2 ulp) and rounds some quotients near a tie the other way.
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) * inv_qmax, 1e-12)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -qmax), qmax)
    if IS_INT:
        q = tl.where(q >= 0, tl.floor(q + 0.5), -tl.floor(-q + 0.5))
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * num_groups + g, scale)


def per_token_group_quant(x: torch.Tensor, dtype: torch.dtype,
                          group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> q (M, K) in dtype (float8_e4m3fn or int8), scale (M, ceil(K / group)) fp32;
    group None quantizes per token. The Triton kernel on CUDA, the torch reference elsewhere."""
    if x.is_cuda:
        return per_token_group_quant_triton(x, dtype, group)
    return per_token_group_quant_ref(x, dtype, group)


def per_token_group_quant_triton(x: torch.Tensor, dtype: torch.dtype,
                                 group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of per_token_group_quant (one program per row and group)."""
    qmax = _qmax(dtype)
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"activations must be a row-major (M, K) matrix, got {tuple(x.shape)}")
    m, k = x.shape
    group = group or k
    ng = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    scale = torch.empty((m, ng), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(group)
        _group_quant_kernel[(m, ng)](x, q, scale, m, k, x.stride(0), q.stride(0), ng, qmax, 1.0 / qmax,
                                     GROUP=group, BLOCK=block, IS_INT=dtype == torch.int8,
                                     num_warps=min(16, max(1, block // 256)))
    return q, scale


def block_dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w (N, K) quantized, scale (ceil(N / bn), ceil(K / bk)) -> w * scale in float32."""
    n, k = w.shape
    bn, bk = block
    s = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # (N, K)
    return w.float() * s


def w8a8_block_matmul_ref(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor,
                          b_s: torch.Tensor, block: tuple[int, int],
                          out_dtype: torch.dtype) -> torch.Tensor:
    """Reference: (a_q * a_s per group of bk) @ (b_q * b_s per bn x bk block)^T in float32."""
    k = a_q.shape[1]
    a = a_q.float() * a_s.float().repeat_interleave(block[1], 1)[:, :k]  # (M, K)
    return (a @ block_dequantize(b_q, b_s, block).t()).to(out_dtype)


@triton.jit(do_not_specialize=["M"])
def _block_fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, stride_am, stride_bn,
                           stride_cm, num_kb, BN_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # NOTE: BLOCK_K equals the weight's block width, so each K step has one activation scale
    # per row and one weight scale per column: acc += dot(a, b) * a_s * b_s.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # (BLOCK_K, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, num_kb):
        k_mask = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        a_s = tl.load(as_ptr + offs_m * num_kb + kb, mask=m_mask, other=0.0)
        b_s = tl.load(bs_ptr + (offs_n // BN_SCALE) * num_kb + kb, mask=n_mask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def w8a8_block_fp8_matmul(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor,
                          b_s: torch.Tensor, block: tuple[int, int],
                          out_dtype: torch.dtype) -> torch.Tensor:
    """C (M, N) = A B^T with A (M, K) fp8 per-token-group scaled (a_s (M, ceil(K / bk))) and
    B (N, K) fp8 block scaled (b_s (ceil(N / bn), ceil(K / bk)))."""
    m, k = a_q.shape
    n = b_q.shape[0]
    bn, bk = block
    num_kb = triton.cdiv(k, bk)
    if b_q.shape[1] != k or a_s.shape != (m, num_kb) or b_s.shape != (triton.cdiv(n, bn), num_kb):
        raise ValueError(f"block GEMM shapes disagree: a {tuple(a_q.shape)}, a_s "
                         f"{tuple(a_s.shape)}, b {tuple(b_q.shape)}, b_s {tuple(b_s.shape)}, "
                         f"block {block}")
    c = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0:
        return c
    # NOTE: decode (small M) is weight-bandwidth bound: narrow N tiles spread the weight over
    # more programs; prefill takes wider tiles.
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = min(64 if m <= 32 else 128, bn)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_fp8_gemm_kernel[grid](a_q, a_s, b_q, b_s.contiguous(), c, m, n, k, a_q.stride(0),
                                 b_q.stride(0), c.stride(0), num_kb, BN_SCALE=bn,
                                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
                                 num_warps=4, num_stages=3 if a_q.is_cuda else 1)
    return c
