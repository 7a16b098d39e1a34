"""The sampler's counter-based noise: a 32-bit hash of (seed, step, token) turned into log(Exp(1)) draws.

Everything integer here is exact (int64 tensors holding 32-bit values), so any implementation of the same
hash (the Triton kernel in peregrine/kernels/sampling.py does it in uint32) draws the same uniforms.
"""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
# NOTE: multipliers < 2**31 keep every product of a 32-bit value below 2**63, so the int64 arithmetic
# never overflows (overflow of signed tensors is not something torch promises on every backend).
MIX_C1 = 0x39BCD44B
MIX_C2 = 0x3792B149
SEED_SALT = 0x2545F491
TOKEN_SALT = 0x1B873593
U_BITS = 23  # bits of each hash used for the uniform; (x + 0.5) * 2**-23 is exact in float32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective 32-bit integer mixer, in place on an int64 tensor holding values in [0, 2**32)."""
    x.bitwise_xor_(x >> 16)
    x.mul_(MIX_C1).bitwise_and_(M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(MIX_C2).bitwise_and_(M32)
    x.bitwise_xor_(x >> 16)
    return x


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """(B,) int64 32-bit keys of the random stream of each (seed, step)."""
    key = _mix32((seeds & M32) ^ SEED_SALT)  # (B,)
    key = _mix32(key.bitwise_xor_((seeds >> 32) & M32))
    key = _mix32(key.bitwise_xor_(steps & M32))
    return _mix32(key.bitwise_xor_((steps >> 32) & M32))


def token_hashes(token_ids: torch.Tensor) -> torch.Tensor:
    """int64 32-bit hashes of token ids (a bijection on ids < 2**32)."""
    return _mix32(_mix32((token_ids.long() & M32) ^ TOKEN_SALT))


def as_int32_bits(hashes: torch.Tensor) -> torch.Tensor:
    """The same 32-bit values as int32 (two's complement bits), the form the Triton kernel reads."""
    # NOTE: explicit wrap instead of relying on how .to(int32) treats out-of-range int64 values.
    return (hashes - ((hashes >> 31) << 32)).to(torch.int32)


def log_exponentials(keys: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    """log(E) with E ~ Exp(1) for every (row, token): keys (B, 1), token_hash (1, N) or (B, N) -> (B, N)."""
    x = _mix32(keys ^ token_hash)  # (B, N) int64
    u = (x >> (32 - U_BITS)).to(torch.float32)  # (B, N)
    # NOTE: u lies in [2**-24, 1 - 2**-24], so E = -log(u) is in [6e-8, 16.6] and log(E) is finite: a row
    # whose only kept token drew the extreme noise still picks it. The price of 23-bit uniforms: tokens
    # rarer than ~1e-7 of the top kept token are slightly under-drawn, and below ~4e-9 never drawn (the
    # same resolution as torch's float32 exponential_(), which vLLM uses).
    return u.add_(0.5).mul_(2.0 ** -U_BITS).log_().neg_().log_()
