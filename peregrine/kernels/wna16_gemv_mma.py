"""The weight-only int GEMV's tensor-core variant (wna16_gemv.py launches it): 4 / 8-bit weights,
16-bit activations, sm_90+ on CUDA (packed bf16 subtraction); the interpreter runs its plain-Triton
dequantization anywhere."""
from __future__ import annotations

import triton
import triton.language as tl

from peregrine.kernels.gemv import finish_split_k

# Each word becomes 16-bit pairs (q - zero) in registers, exact (|q - zero| <= 255 fits 16-bit
# floats), and one tl.dot multiplies the (BLOCK_N, BLOCK_K) tile by x^T padded to _MMA_ROWS
# columns: the weight is the dot's first operand, so the padding costs x, not the weight. The
# pairs come out of a word in the order the bit tricks give (4-bit: nibbles 0,4 1,5 2,6 3,7), so
# x's K block is loaded in that same order: the sum over K does not care.
_MMA_ROWS = tl.constexpr(16)
# Tile column PACK * w + i holds value PAIR_ORDER[bits][i] of word w (x is loaded likewise).
PAIR_ORDER = {4: (0, 4, 1, 5, 2, 6, 3, 7), 8: (0, 1, 2, 3)}
# 4-bit: shift + lop3 into the exponent of 128 (bf16) / 1024 (fp16), then one packed subtraction
# of (magic + zero): 11 instructions per 8 values. $8: the word, $9: (magic + zero) twice.
_ASM_U4 = """{
.reg .b32 t1, t2, t3, p0, p1, p2, p3;
shr.u32 t1, $8, 4;
shr.u32 t2, $8, 8;
shr.u32 t3, $8, 12;
lop3.b32 p0, $8, 0x000F000F, MAGIC, 0xEA;
lop3.b32 p1, t1, 0x000F000F, MAGIC, 0xEA;
lop3.b32 p2, t2, 0x000F000F, MAGIC, 0xEA;
lop3.b32 p3, t3, 0x000F000F, MAGIC, 0xEA;
SUB p0, p0, $9;
SUB p1, p1, $9;
SUB p2, p2, $9;
SUB p3, p3, $9;
mov.b32 {$0, $1}, p0;
mov.b32 {$2, $3}, p1;
mov.b32 {$4, $5}, p2;
mov.b32 {$6, $7}, p3;
}"""
ASM_U4_BF16 = tl.constexpr(_ASM_U4.replace("MAGIC", "0x43004300").replace("SUB", "sub.bf16x2"))
ASM_U4_F16 = tl.constexpr(_ASM_U4.replace("MAGIC", "0x64006400").replace("SUB", "sub.f16x2"))
# 8-bit, fp16: one prmt puts two bytes under 1024's exponent, one packed subtraction of
# (1024 + zero). $4: the word, $5: (1024 + zero) twice.
ASM_U8_F16 = tl.constexpr("""{
.reg .b32 m, p0, p1;
mov.b32 m, 0x64646464;
prmt.b32 p0, $4, m, 0x4140;
prmt.b32 p1, $4, m, 0x4342;
sub.f16x2 p0, p0, $5;
sub.f16x2 p1, p1, $5;
mov.b32 {$0, $1}, p0;
mov.b32 {$2, $3}, p1;
}""")
# 8-bit, bf16 (8 mantissa bits are too few for magic + q): 2^23 + q in float32 by prmt, minus
# (2^23 + zero), and the exact integer's top halves packed by prmt. $5: (2^23 + zero) as f32.
ASM_U8_BF16 = tl.constexpr("""{
.reg .b32 m, f0, f1, f2, f3, p0, p1;
mov.b32 m, 0x4B000000;
prmt.b32 f0, $4, m, 0x7650;
prmt.b32 f1, $4, m, 0x7651;
prmt.b32 f2, $4, m, 0x7652;
prmt.b32 f3, $4, m, 0x7653;
sub.f32 f0, f0, $5;
sub.f32 f1, f1, $5;
sub.f32 f2, f2, $5;
sub.f32 f3, f3, $5;
prmt.b32 p0, f0, f1, 0x7632;
prmt.b32 p1, f2, f3, 0x7632;
mov.b32 {$0, $1}, p0;
mov.b32 {$2, $3}, p1;
}""")


@triton.jit
def _value(words, shift, mask, z, ACT: tl.constexpr):
    """(q - z) of the value at `shift` in every word, in ACT (the interpreter's dequantization)."""
    return (((words >> shift) & mask).to(tl.float32) - z).to(ACT)


@triton.jit
def _dequant_tile(words, z, BITS: tl.constexpr, ACT: tl.constexpr, ASM: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_N, BLOCK_K) q - z in ACT from (BLOCK_N, words) packed words and (BLOCK_N,) float32
    zeros, each word's values in the asm's pair order (4-bit: 0 4 1 5 2 6 3 7; 8-bit: 0 1 2 3)."""
    zc = z[:, None]  # (BN, 1)
    if BITS == 4:
        if ASM and ACT == tl.bfloat16:
            zb = (zc + 128.0).to(ACT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                ASM_U4_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, zb | (zb << 16)],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        elif ASM:
            zb = (zc + 1024.0).to(ACT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                ASM_U4_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, zb | (zb << 16)],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            o0 = _value(words, 0, 15, zc, ACT)
            o1 = _value(words, 16, 15, zc, ACT)
            o2 = _value(words, 4, 15, zc, ACT)
            o3 = _value(words, 20, 15, zc, ACT)
            o4 = _value(words, 8, 15, zc, ACT)
            o5 = _value(words, 24, 15, zc, ACT)
            o6 = _value(words, 12, 15, zc, ACT)
            o7 = _value(words, 28, 15, zc, ACT)
        # NOTE: join adds a last axis; pairing o_i with o_{i+4} first makes the flattened order
        # o0..o7, so each word's 8 values are contiguous (one 16-byte store to shared memory).
        tile = tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)),
                       tl.join(tl.join(o1, o5), tl.join(o3, o7)))  # (BN, W, 2, 2, 2)
    else:
        if ASM and ACT == tl.bfloat16:
            zw = (zc + 8388608.0).to(tl.int32, bitcast=True)
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                ASM_U8_BF16, "=h,=h,=h,=h,r,r", [words, zw], dtype=(tl.bfloat16,) * 4,
                is_pure=True, pack=1)
        elif ASM:
            zh = (zc + 1024.0).to(ACT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                ASM_U8_F16, "=h,=h,=h,=h,r,r", [words, zh | (zh << 16)],
                dtype=(tl.float16,) * 4, is_pure=True, pack=1)
        else:
            o0 = _value(words, 0, 255, zc, ACT)
            o1 = _value(words, 8, 255, zc, ACT)
            o2 = _value(words, 16, 255, zc, ACT)
            o3 = _value(words, 24, 255, zc, ACT)
        tile = tl.join(tl.join(o0, o2), tl.join(o1, o3))  # (BN, W, 2, 2)
    return tl.reshape(tile, (BLOCK_N, BLOCK_K))


@triton.jit
def _group_row(s_ptr, z_ptr, grp, N, offs_n, n_mask, BITS: tl.constexpr, HAS_ZP: tl.constexpr,
               EVEN_N: tl.constexpr):
    """Group grp's (BLOCK_N,) float32 scales and zero points (2^(bits-1) without them)."""
    if EVEN_N:
        s = tl.load(s_ptr + grp * N + offs_n).to(tl.float32)
    else:
        s = tl.load(s_ptr + grp * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_ZP:
        if EVEN_N:
            z = tl.load(z_ptr + grp * N + offs_n).to(tl.float32)
        else:
            z = tl.load(z_ptr + grp * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    else:
        z = tl.full(offs_n.shape, 1 << (BITS - 1), tl.float32)
    return s, z


@triton.jit(do_not_specialize=["M", "stride_cm", "K_ITERS", "SPLIT_K"])
def _wna16_gemv_mma_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, part_ptr, lock_ptr, c_ptr,
    M, N, K, stride_cm, K_ITERS, SPLIT_K,
    BITS: tl.constexpr, HAS_ZP: tl.constexpr, GROUP: tl.constexpr, ASM: tl.constexpr,
    DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SPLIT: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PACK
    ROWS: tl.constexpr = _MMA_ROWS
    ACT: tl.constexpr = c_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WORDS)  # (W,)
    offs_m = tl.arange(0, ROWS)  # (R,)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)  # (BK,)
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    q_rows = q_ptr + (split * K_ITERS * WORDS + offs_w)[None, :] * N + offs_n[:, None]  # (BN, W)
    # NOTE: the last split may hold fewer K blocks: its loop stops at K, no masks needed.
    iters = tl.minimum(K_ITERS, tl.cdiv(K, BLOCK_K) - split * K_ITERS)
    first = tl.minimum(split * K_ITERS * BLOCK_K, K - 1) // GROUP
    s_next, z_next = _group_row(s_ptr, z_ptr, first, N, offs_n, n_mask, BITS, HAS_ZP, EVEN_N)
    for it in range(0, iters):
        k0 = (split * K_ITERS + it) * BLOCK_K
        if EVEN_N and EVEN_K:
            words = tl.load(q_rows)  # (BN, W) int32
        else:
            w_ok = (k0 // PACK + offs_w) < K // PACK  # (W,)
            words = tl.load(q_rows, mask=w_ok[None, :] & n_mask[:, None], other=0)
        q_rows += WORDS * N
        # NOTE: the next block's scales and zeros are loaded a block ahead (the words are
        # pipelined by the compiler, these are not); past K, the last group is read again.
        s, z = s_next, z_next
        s_next, z_next = _group_row(s_ptr, z_ptr, tl.minimum(k0 + BLOCK_K, K - 1) // GROUP, N,
                                    offs_n, n_mask, BITS, HAS_ZP, EVEN_N)
        wq = _dequant_tile(words, z, BITS, ACT, ASM, BLOCK_N, BLOCK_K)  # (BN, BK)
        kk = k0 + offs_k  # (BK,)
        if EVEN_K:
            x = tl.load(a_ptr + offs_m[:, None] * K + kk[None, :], mask=m_mask[:, None],
                        other=0.0)  # (R, BK)
        else:
            x = tl.load(a_ptr + offs_m[:, None] * K + kk[None, :],
                        mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
        if BITS == 4:  # tile column 8w + 2c + h holds nibble 4h + c of word w: x likewise
            x = tl.reshape(tl.permute(tl.reshape(x, (ROWS, WORDS, 2, 4)), (0, 1, 3, 2)),
                           (ROWS, BLOCK_K))
        # NOTE: q - zero and x are exact in ACT; products and sums are float32.
        acc += tl.dot(wq.to(DOT), tl.trans(x.to(DOT))) * s[:, None]  # (BN, R)
    if HAS_SPLIT:
        dst = part_ptr + (split * M + offs_m).to(tl.int64)[None, :] * N + offs_n[:, None]
        tl.store(dst, acc, mask=n_mask[:, None] & m_mask[None, :])
    else:
        tl.store(c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None], acc.to(ACT),
                 mask=n_mask[:, None] & m_mask[None, :])
    finish_split_k(part_ptr, lock_ptr, c_ptr, M, N, pid_n, offs_n, n_mask, stride_cm,
                   SPLIT_K, HAS_SPLIT, ROWS, BLOCK_N)
