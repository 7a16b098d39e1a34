"""The weight-only int GEMV's packed-half variant (wna16_gemv.py launches it): 4-bit (and 6-bit)
weights, one row of x, whole K blocks inside one group.

The in-place variant spends an AND-OR, a subtraction and a float32 FMA on every 4-bit value, and
at an H200's issue rate that caps it near 3.6 TB/s of weights before anything else it issues.
Here two values share each instruction: a word w's 8 values become four fp16 pairs by one AND-OR
each into the mantissas of 1024 (fp16 0x6400: its ulp is 1), lanes (v0, v4) and (16 v1, 16 v5)
from w, (v2, v6) and (16 v3, 16 v7) from w >> 8; one packed subtraction of (1024 + zero) or
fused multiply-add by (1/16, -(64 + zero)) leaves (q - zero) exactly in both lanes, and one
packed FMA multiplies it by the pair of inputs it meets. The word's four pair products are summed
in fp16 lanes, then the two lanes in float32: 16 instructions per 8 values instead of about 25.

6-bit weights keep their low nibbles in the 4-bit words and their two high bits, 16 values to
a word, in a second plane (wna16.py's layout): one prmt brings a word row's 16 high bits to the
pairs' byte positions, and one shift and one OR per pair put them above the nibble in the
mantissa (1024 + q, or 1024 + 16 q, with q < 64 still exact), so a word costs 8 instructions
more than at 4 bits.

x enters as fp16 pairs (x0, x4), (x1, x5), (x2, x6), (x3, x7), built once per word row and
scaled by 2^-8 (undone with the group's scale in float32): q - zero is at most 15 in size (63
at 6 bits), so four products then stay far from fp16's 65504 for any input below ~2^18 (~2^16)
in size, while inputs down to 2^-6 keep fp16's 11 significant bits. The result differs from the
float32 variants by fp16 rounding of x and of the four-product sums (a relative 2^-11 each),
well inside what the bf16 output keeps. The interpreter (ASM off) computes the same sums in float32.

On an H200 at Llama-3-8B's shapes the halved instructions alone bought nothing (the kernel
waits on memory latency, not on issue slots); with PREFETCH (each K block's loads issued an
iteration ahead, in registers) it takes about 8% less time than the in-place variant. STAGES
keeps more blocks in flight through shared memory instead (asynchronous copies the compiler
pipelines); on an H200 that measured slower than one block ahead in registers, as did bulk
tensor copies (TMA) through a tensor descriptor.
"""
from __future__ import annotations

import triton
import triton.language as tl

from peregrine.kernels._utils import pdl_release, pdl_wait
from peregrine.kernels.activation import silu_mul
from peregrine.kernels.gemv import finish_split_k, store_partial
from peregrine.kernels.wna16_gemv_inplace import _load_block, load_x_pairs

_X_SCALE = tl.constexpr(0.00390625)  # 2^-8 on x; the float32 sums get 2^8 back
_UNDO = tl.constexpr(256.0)
# The end of the packed dot products below: the f16x2 sum `a` of a word's four pair products,
# its two lanes added in float32 into $0 (registers l, u (.b16) and fl, fu (.f32) declared).
ASM_LANE_SUM = """mov.b32 {l, u}, a;
cvt.f32.f16 fl, l;
cvt.f32.f16 fu, u;
add.f32 $0, fl, fu;
}"""
_ASM_HEAD = """{
.reg .b32 h, t, a, s;
.reg .b16 l, u;
.reg .f32 fl, fu;
mov.b32 s, 0x2C002C00;
"""


def _asm_word(word: str, pairs: tuple[str, str, str, str], c_lo: str, c_hi: str,
              first: bool) -> str:
    """PTX adding one word's four pair products (q - zero) x into the f16x2 sum `a` (set by
    the first word): lanes of w & 0x000F000F are 1024 + q (fp16 1024's ulp is 1), minus
    c_lo = 1024 + zero; lanes of w & 0x00F000F0 are 1024 + 16 q, times 1/16 (s) plus
    c_hi = -(64 + zero); the same for w >> 8."""
    p0, p1, p2, p3 = pairs
    start = f"mul.f16x2 a, t, {p0};" if first else f"fma.rn.f16x2 a, t, {p0}, a;"
    return f"""shr.u32 h, {word}, 8;
lop3.b32 t, {word}, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t, t, {c_lo};
{start}
lop3.b32 t, {word}, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 t, t, s, {c_hi};
fma.rn.f16x2 a, t, {p1}, a;
lop3.b32 t, h, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t, t, {c_lo};
fma.rn.f16x2 a, t, {p2}, a;
lop3.b32 t, h, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 t, t, s, {c_hi};
fma.rn.f16x2 a, t, {p3}, a;
"""


# One word's 8 4-bit values against x's four fp16 pairs: $1 the word, $2..$5 the pairs,
# $6 (1024 + zero) and $7 -(64 + zero) as fp16 pairs. $0 = sum_j (q_j - zero) x_j (x scaled).
ASM_DOT_U4 = tl.constexpr(_ASM_HEAD + _asm_word("$1", ("$2", "$3", "$4", "$5"), "$6", "$7", True)
                          + ASM_LANE_SUM)
# Two words of one column (word rows r and r + W/2) against their rows' pairs: $1, $2 the
# words, $3..$6 and $7..$10 their pairs, $11 (1024 + zero) and $12 -(64 + zero). The eight pair
# products are summed in fp16 lanes before the one float32 sum of the lanes.
ASM_DOT_U4_X2 = tl.constexpr(
    _ASM_HEAD + _asm_word("$1", ("$3", "$4", "$5", "$6"), "$11", "$12", True)
    + _asm_word("$2", ("$7", "$8", "$9", "$10"), "$11", "$12", False) + ASM_LANE_SUM)
# The same for 6-bit values: $8 the word's high-bits word (two bits per value, 16 values: this
# word row's 8 in its byte pair that $9, a prmt selector, moves to bytes 0 and 2), OR-ed into
# each pair's mantissas above the low nibble: 1024 + q, or 1024 + 16 q, q < 64.
ASM_DOT_U6 = tl.constexpr("""{
.reg .b32 h, t, a, s, e, g, zz;
.reg .b16 l, u;
.reg .f32 fl, fu;
mov.b32 s, 0x2C002C00;
mov.b32 zz, 0;
prmt.b32 e, $8, zz, $9;
shr.u32 h, $1, 8;
lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA;
shl.b32 g, e, 4;
lop3.b32 t, g, 0x00300030, t, 0xEA;
sub.f16x2 t, t, $6;
mul.f16x2 a, t, $2;
lop3.b32 t, $1, 0x00F000F0, 0x64006400, 0xEA;
shl.b32 g, e, 6;
lop3.b32 t, g, 0x03000300, t, 0xEA;
fma.rn.f16x2 t, t, s, $7;
fma.rn.f16x2 a, t, $3, a;
lop3.b32 t, h, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t, e, 0x00300030, t, 0xEA;
sub.f16x2 t, t, $6;
fma.rn.f16x2 a, t, $4, a;
lop3.b32 t, h, 0x00F000F0, 0x64006400, 0xEA;
shl.b32 g, e, 2;
lop3.b32 t, g, 0x03000300, t, 0xEA;
fma.rn.f16x2 t, t, s, $7;
fma.rn.f16x2 a, t, $5, a;
""" + ASM_LANE_SUM)
# Two float32 values as one fp16 pair: $1 in the high lane, $2 in the low one.
ASM_PAIR = tl.constexpr("cvt.rn.f16x2.f32 $0, $1, $2;")


@triton.jit
def _x_word_inputs(a_ptr, a64_ptr, word, w_mask, X_BF16: tl.constexpr, EVEN_K: tl.constexpr):
    """Row 0's inputs of the word rows (W,): x[8 w + j] * 2^-8, j = 0..7, float32."""
    if X_BF16:  # two 8-byte loads per word row: inputs 0..3 and 4..7
        xa, xb = load_x_pairs(a64_ptr + word * 2, w_mask, EVEN_K)
        x0, x1, x2, x3, x4, x5, x6, x7 = _bf16_unpack(xa, xb)
    else:
        kk = word * 8
        if EVEN_K:
            x0 = tl.load(a_ptr + kk).to(tl.float32)
            x1 = tl.load(a_ptr + kk + 1).to(tl.float32)
            x2 = tl.load(a_ptr + kk + 2).to(tl.float32)
            x3 = tl.load(a_ptr + kk + 3).to(tl.float32)
            x4 = tl.load(a_ptr + kk + 4).to(tl.float32)
            x5 = tl.load(a_ptr + kk + 5).to(tl.float32)
            x6 = tl.load(a_ptr + kk + 6).to(tl.float32)
            x7 = tl.load(a_ptr + kk + 7).to(tl.float32)
        else:
            x0 = tl.load(a_ptr + kk, mask=w_mask, other=0.0).to(tl.float32)
            x1 = tl.load(a_ptr + kk + 1, mask=w_mask, other=0.0).to(tl.float32)
            x2 = tl.load(a_ptr + kk + 2, mask=w_mask, other=0.0).to(tl.float32)
            x3 = tl.load(a_ptr + kk + 3, mask=w_mask, other=0.0).to(tl.float32)
            x4 = tl.load(a_ptr + kk + 4, mask=w_mask, other=0.0).to(tl.float32)
            x5 = tl.load(a_ptr + kk + 5, mask=w_mask, other=0.0).to(tl.float32)
            x6 = tl.load(a_ptr + kk + 6, mask=w_mask, other=0.0).to(tl.float32)
            x7 = tl.load(a_ptr + kk + 7, mask=w_mask, other=0.0).to(tl.float32)
    return (x0 * _X_SCALE, x1 * _X_SCALE, x2 * _X_SCALE, x3 * _X_SCALE, x4 * _X_SCALE,
            x5 * _X_SCALE, x6 * _X_SCALE, x7 * _X_SCALE)


@triton.jit
def _bf16_unpack(xa, xb):
    """The eight bf16 inputs of word rows read as two int64 (W,) (inputs 0..3, 4..7), float32."""
    a0 = xa.to(tl.int32)
    a1 = (xa >> 32).to(tl.int32)
    b0 = xb.to(tl.int32)
    b1 = (xb >> 32).to(tl.int32)
    return ((a0 << 16).to(tl.float32, bitcast=True), (a0 & -65536).to(tl.float32, bitcast=True),
            (a1 << 16).to(tl.float32, bitcast=True), (a1 & -65536).to(tl.float32, bitcast=True),
            (b0 << 16).to(tl.float32, bitcast=True), (b0 & -65536).to(tl.float32, bitcast=True),
            (b1 << 16).to(tl.float32, bitcast=True), (b1 & -65536).to(tl.float32, bitcast=True))


@triton.jit
def _gated_word_inputs(a_ptr, word, w_mask, K, EVEN_K: tl.constexpr, WORDS: tl.constexpr):
    """Row 0's inputs of the word rows (W,) when x is silu(h[:K]) * h[K:] of a gate-and-up row
    h (2K,): each input computed once, by one thread, on a (W, 8) tile, rounded to h's dtype as
    the activation kernel's output would be, then split into the eight (W,) columns, * 2^-8."""
    offs = tl.arange(0, 8)
    kk = word[:, None] * 8 + offs[None, :]  # (W, 8)
    if EVEN_K:
        g = tl.load(a_ptr + kk)
        u = tl.load(a_ptr + K + kk)
    else:
        mask = w_mask[:, None] & (offs < 8)[None, :]
        g = tl.load(a_ptr + kk, mask=mask, other=0.0)
        u = tl.load(a_ptr + K + kk, mask=mask, other=0.0)
    x = silu_mul(g.to(tl.float32), u.to(tl.float32)).to(a_ptr.dtype.element_ty)
    x = x.to(tl.float32) * _X_SCALE
    even, odd = tl.split(tl.reshape(x, (WORDS, 4, 2)))  # inputs 0, 2, 4, 6 / 1, 3, 5, 7
    e0, e1 = tl.split(tl.reshape(even, (WORDS, 2, 2)))  # (0, 4), (2, 6)
    o0, o1 = tl.split(tl.reshape(odd, (WORDS, 2, 2)))  # (1, 5), (3, 7)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _pair(hi, lo):
    """fp16 pair bits (lo in the low lane) of two float32 (W,) vectors."""
    return tl.inline_asm_elementwise(ASM_PAIR, "=r,r,r", [hi, lo], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _block_sums(words, z, a_ptr, a64_ptr, word, w_mask, ASM: tl.constexpr, X_BF16: tl.constexpr,
                EVEN_K: tl.constexpr, K=0, GATED: tl.constexpr = False, xa=None, xb=None,
                hi=None, BITS: tl.constexpr = 4, PAIR_ROWS: tl.constexpr = False):
    """(W, BN) float32: each word's sum_j (q_j - zero) x[8 w + j] * 2^-8 for the block's words
    (W, BN) and zero points z (BN,); GATED: x = silu(h[:K]) * h[K:] of the row h at a_ptr;
    xa, xb: the block's bf16 inputs already loaded (two int64 per word row); BITS 6: hi (W, BN)
    the high-bits words (16 values each: word row w's 8 in half w % 2); PAIR_ROWS (4 bits):
    (W/2, BN), rows r and r + W/2 summed (in fp16 lanes before float32 on the GPU)."""
    if xa is not None:
        x0, x1, x2, x3, x4, x5, x6, x7 = _bf16_unpack(xa, xb)
        x0, x1, x2, x3 = x0 * _X_SCALE, x1 * _X_SCALE, x2 * _X_SCALE, x3 * _X_SCALE
        x4, x5, x6, x7 = x4 * _X_SCALE, x5 * _X_SCALE, x6 * _X_SCALE, x7 * _X_SCALE
    elif GATED:
        x0, x1, x2, x3, x4, x5, x6, x7 = _gated_word_inputs(a_ptr, word, w_mask, K, EVEN_K,
                                                            words.shape[0])
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_word_inputs(a_ptr, a64_ptr, word, w_mask, X_BF16,
                                                        EVEN_K)
    if ASM:
        zi = z.to(tl.uint32)  # (BN,) integer zero points, 0..15 (0..63 at 6 bits)
        lo_bits = 0x6400 + zi  # fp16 1024 + zero
        hi_bits = 0xD400 + 16 * zi  # fp16 -(64 + zero)
        c_lo = ((lo_bits << 16) | lo_bits).to(tl.int32, bitcast=True)[None, :]
        c_hi = ((hi_bits << 16) | hi_bits).to(tl.int32, bitcast=True)[None, :]
        p0 = _pair(x4, x0)  # (W,)
        p1 = _pair(x5, x1)
        p2 = _pair(x6, x2)
        p3 = _pair(x7, x3)
        if PAIR_ROWS:
            we, wo = _row_halves(words)  # (W/2, BN): rows r and r + W/2
            p0e, p0o = _vec_halves(p0)
            p1e, p1o = _vec_halves(p1)
            p2e, p2o = _vec_halves(p2)
            p3e, p3o = _vec_halves(p3)
            t = tl.inline_asm_elementwise(
                ASM_DOT_U4_X2, "=r,r,r,r,r,r,r,r,r,r,r,r,r",
                [we, wo, p0e[:, None], p1e[:, None], p2e[:, None], p3e[:, None], p0o[:, None],
                 p1o[:, None], p2o[:, None], p3o[:, None], c_lo, c_hi],
                dtype=tl.float32, is_pure=True, pack=1)
        elif BITS == 6:
            # prmt selector: bytes 0, 1 (even word row) or 2, 3 (odd) of hi to bytes 0 and 2
            sel = tl.where(word % 2 == 0, 0x4140, 0x4342)[:, None]  # (W, 1)
            t = tl.inline_asm_elementwise(
                ASM_DOT_U6, "=r,r,r,r,r,r,r,r,r,r",
                [words, p0[:, None], p1[:, None], p2[:, None], p3[:, None], c_lo, c_hi, hi, sel],
                dtype=tl.float32, is_pure=True, pack=1)
        else:
            t = tl.inline_asm_elementwise(
                ASM_DOT_U4, "=r,r,r,r,r,r,r,r",
                [words, p0[:, None], p1[:, None], p2[:, None], p3[:, None], c_lo, c_hi],
                dtype=tl.float32, is_pure=True, pack=1)
    else:
        zc = z[None, :]
        hs = (word % 2 * 16)[:, None]  # (W, 1): this word row's half of its high-bits word
        t = (_value(words, hi, 0, hs, BITS) - zc) * x0[:, None]
        t += (_value(words, hi, 1, hs, BITS) - zc) * x1[:, None]
        t += (_value(words, hi, 2, hs, BITS) - zc) * x2[:, None]
        t += (_value(words, hi, 3, hs, BITS) - zc) * x3[:, None]
        t += (_value(words, hi, 4, hs, BITS) - zc) * x4[:, None]
        t += (_value(words, hi, 5, hs, BITS) - zc) * x5[:, None]
        t += (_value(words, hi, 6, hs, BITS) - zc) * x6[:, None]
        t += (_value(words, hi, 7, hs, BITS) - zc) * x7[:, None]
        if PAIR_ROWS:  # the same float32 sums, the two halves of the rows added
            te, to = _row_halves(t)
            t = te + to
    return t


@triton.jit
def _row_halves(t):
    """(W/2, BN) rows r and r + W/2 of a (W, BN) tile."""
    return tl.split(tl.permute(tl.reshape(t, (2, t.shape[0] // 2, t.shape[1])), (1, 2, 0)))


@triton.jit
def _vec_halves(v):
    """(W/2,) entries r and r + W/2 of a (W,) vector."""
    return tl.split(tl.permute(tl.reshape(v, (2, v.shape[0] // 2)), (1, 0)))


@triton.jit
def _value(words, hi, j: tl.constexpr, hs, BITS: tl.constexpr):
    """Value j of each word (float32): its low nibble, and for 6 bits its two high bits (at
    2 j + hs in hi)."""
    q = (words >> (4 * j)) & 0xF
    if BITS == 6:
        q += ((hi >> (hs + 2 * j)) & 3) << 4
    return q.to(tl.float32)


@triton.jit
def _load_words(q_ptr, qhi_ptr, s_ptr, z_ptr, k0, K, N, offs_w, offs_n, n_mask, k_end,
                GROUP: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, BITS: tl.constexpr):
    """The K block at k0: (words, high-bits words (6 bits; else the words again), scales,
    zero points); nothing read from K or k_end on."""
    words, s, z = _load_block(q_ptr, s_ptr, z_ptr, k0, K, N, offs_w, offs_n, n_mask, k_end,
                              GROUP, 4, HAS_ZP, BLOCK_N, BLOCK_K)
    hi = words
    if BITS == 6:
        word = k0 // 8 + offs_w  # (W,): two word rows share a row of high-bits words
        w_mask = (word < K // 8) & (word < k_end // 8)
        hi = tl.load(qhi_ptr + (word // 2).to(tl.int64)[:, None] * N + offs_n[None, :],
                     mask=w_mask[:, None] & n_mask[None, :], other=0)
        if not HAS_ZP:
            z = tl.full((BLOCK_N,), 32.0, tl.float32)
    return words, hi, s, z


@triton.jit(do_not_specialize=["stride_cm", "K_ITERS", "SPLIT_K"])
def _wna16_gemv_half2_kernel(
    a_ptr, a64_ptr, q_ptr, qhi_ptr, s_ptr, z_ptr, part_ptr, lock_ptr, c_ptr,
    M, N, K, stride_cm, K_ITERS, SPLIT_K,
    GROUP: tl.constexpr, HAS_ZP: tl.constexpr, ASM: tl.constexpr, X_BF16: tl.constexpr,
    EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_SPLIT: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr = 1,
    GATED: tl.constexpr = False, X_AHEAD: tl.constexpr = False, BITS: tl.constexpr = 4,
    PAIR_ROWS: tl.constexpr = False,
):
    """GATED: x is silu(h[:K]) * h[K:] of the row h (2K,) at a_ptr, computed as it is read.
    X_AHEAD (bf16 x, PREFETCH 1): each block's inputs are loaded an iteration ahead too, with
    its weights. BITS 6: the high bits come from qhi_ptr (16 values per word). PAIR_ROWS (4
    bits): two word rows of a column are summed in fp16 lanes before float32."""
    WORDS: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WORDS)  # (W,)
    acc = tl.zeros((WORDS // 2 if PAIR_ROWS else WORDS, BLOCK_N), dtype=tl.float32)
    k_end = (split + 1) * K_ITERS * BLOCK_K  # this program's K range ends here
    # NOTE: PREFETCH blocks ahead (0, 1 or 2) are loaded into registers before each block's
    # arithmetic, so that many blocks' loads are in flight while it runs.
    k_start = split * K_ITERS * BLOCK_K
    if PREFETCH >= 1:
        nxt_words, nxt_hi, nxt_s, nxt_z = _load_words(
            q_ptr, qhi_ptr, s_ptr, z_ptr, k_start, K, N, offs_w, offs_n, n_mask, k_end, GROUP,
            HAS_ZP, BLOCK_N, BLOCK_K, BITS)
    if PREFETCH >= 2:
        far_words, far_hi, far_s, far_z = _load_words(
            q_ptr, qhi_ptr, s_ptr, z_ptr, k_start + BLOCK_K, K, N, offs_w, offs_n, n_mask, k_end,
            GROUP, HAS_ZP, BLOCK_N, BLOCK_K, BITS)
    pdl_wait(PDL)  # the first blocks' weights (constant) are read before it, x after
    if X_AHEAD:
        word0 = k_start // 8 + offs_w
        nxt_xa, nxt_xb = load_x_pairs(a64_ptr + word0 * 2, word0 < K // 8, False)
    # NOTE: STAGES > 1 (with PREFETCH 0) lets the compiler's pipeliner copy each block's words
    # into shared memory asynchronously (cp.async), STAGES - 1 blocks ahead.
    for it in tl.range(0, K_ITERS, num_stages=STAGES):
        k0 = (split * K_ITERS + it) * BLOCK_K
        word = k0 // 8 + offs_w  # (W,)
        w_mask = word < K // 8
        if PREFETCH >= 2:
            words, hi, s, z = nxt_words, nxt_hi, nxt_s, nxt_z
            nxt_words, nxt_hi, nxt_s, nxt_z = far_words, far_hi, far_s, far_z
            far_words, far_hi, far_s, far_z = _load_words(
                q_ptr, qhi_ptr, s_ptr, z_ptr, k0 + 2 * BLOCK_K, K, N, offs_w, offs_n, n_mask,
                k_end, GROUP, HAS_ZP, BLOCK_N, BLOCK_K, BITS)
        elif PREFETCH == 1:
            words, hi, s, z = nxt_words, nxt_hi, nxt_s, nxt_z
            nxt_words, nxt_hi, nxt_s, nxt_z = _load_words(
                q_ptr, qhi_ptr, s_ptr, z_ptr, k0 + BLOCK_K, K, N, offs_w, offs_n, n_mask, k_end,
                GROUP, HAS_ZP, BLOCK_N, BLOCK_K, BITS)
        else:
            words, hi, s, z = _load_words(q_ptr, qhi_ptr, s_ptr, z_ptr, k0, K, N, offs_w,
                                          offs_n, n_mask, K, GROUP, HAS_ZP, BLOCK_N, BLOCK_K,
                                          BITS)
        if X_AHEAD:
            xa, xb = nxt_xa, nxt_xb
            word1 = word + BLOCK_K // 8  # the next block's word rows (masked past K)
            nxt_xa, nxt_xb = load_x_pairs(a64_ptr + word1 * 2, word1 < K // 8, False)
            t = _block_sums(words, z, a_ptr, a64_ptr, word, w_mask, ASM, X_BF16, EVEN_K, K,
                            GATED, xa, xb, hi, BITS, PAIR_ROWS)
        else:
            t = _block_sums(words, z, a_ptr, a64_ptr, word, w_mask, ASM, X_BF16, EVEN_K, K,
                            GATED, None, None, hi, BITS, PAIR_ROWS)
        acc += t * (s * _UNDO)[None, :]
    pdl_release(PDL)
    store_partial(part_ptr, c_ptr, tl.sum(acc, axis=0), 0, M, N, split, offs_n, n_mask,
                  stride_cm, HAS_SPLIT)
    finish_split_k(part_ptr, lock_ptr, c_ptr, M, N, pid_n, offs_n, n_mask, stride_cm, SPLIT_K,
                   HAS_SPLIT, 1, BLOCK_N)
