"""Fused sampling draw: per row, argmax over kept tokens of logit / T - log(-log u), one read of the logits.

The uniform u(b, v) is the sampler's hashed noise (peregrine/sample/noise.py) recomputed bit for bit in
uint32: row key from (seed, step), xor the token's hash, one more mix, top 23 bits. The float steps follow
the torch path op for op (exact division, two logs, one subtraction), so both paths pick the same token.
Grid: (row, vocab chunk); each program keeps a per-lane running best, and with several chunks a tiny torch
argmax over the (B, chunks) partials finishes the job (the lowest index wins ties, as in torch.argmax).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from peregrine.kernels._utils import is_gpu, next_pow2, num_sms
from peregrine.sample import noise

_MIX_C1 = tl.constexpr(noise.MIX_C1)
_MIX_C2 = tl.constexpr(noise.MIX_C2)
_SEED_SALT = tl.constexpr(noise.SEED_SALT)
_U_SHIFT = tl.constexpr(32 - noise.U_BITS)
_U_SCALE = tl.constexpr(2.0 ** -noise.U_BITS)
_MAX_BLOCK = 1024
_PROGRAMS_PER_SM = 8  # enough loads in flight to stream the logits at full bandwidth
_NUM_WARPS = 4
_BLOCK_C = 512  # partials a lane pass over (B, chunks) takes: one compiled variant for all B


@triton.jit
def _mix32(x):
    # Same steps as noise._mix32, on uint32 (products wrap modulo 2**32; shifts are logical).
    x = x ^ (x >> 16)
    x = x * _MIX_C1
    x = x ^ (x >> 15)
    x = x * _MIX_C2
    x = x ^ (x >> 16)
    return x


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    # NOTE: on a GPU, libdevice's logf is the function torch's CUDA log kernel calls, so the noise
    # matches the torch path bit for bit; the interpreter has no libdevice and uses numpy's log.
    if PRECISE:
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


@triton.jit
def _chunk(logits_ptr, row, pid_c, vocab, chunk, stride_row, BLOCK: tl.constexpr):
    """A program's chunk of its row: (start, end, the row's logits, -inf values and the first
    block's indices to start each lane's running best from)."""
    start = pid_c * chunk
    end = tl.minimum(start + chunk, vocab)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    best_val = tl.full((BLOCK,), float("-inf"), tl.float32)  # (BLOCK,)
    # NOTE: starting indices = the first block's, so a row of all -inf returns its first token.
    best_idx = start + tl.arange(0, BLOCK)  # (BLOCK,)
    return start, end, row_ptr, best_val, best_idx


@triton.jit
def _store_first_max(best_val, best_idx, part_val_ptr, part_idx_ptr, row, pid_c, num_chunks):
    """The lanes' best value and its lowest index into the chunk's partials."""
    top = tl.max(best_val, 0)
    first = tl.min(tl.where(best_val == top, best_idx, 2147483647), 0)
    out = row.to(tl.int64) * num_chunks + pid_c
    tl.store(part_val_ptr + out, top)
    tl.store(part_idx_ptr + out, first.to(tl.int64))


@triton.jit(do_not_specialize=["num_chunks"])
def _argmax_chunks_kernel(logits_ptr, part_val_ptr, part_idx_ptr, vocab, chunk, num_chunks,
                          stride_row, BLOCK: tl.constexpr):
    """The plain argmax of each chunk of a row (the earliest index keeps a tie) into the
    partials."""
    row = tl.program_id(0)
    pid_c = tl.program_id(1)
    start, end, row_ptr, best_val, best_idx = _chunk(logits_ptr, row, pid_c, vocab, chunk,
                                                     stride_row, BLOCK)
    offs = tl.arange(0, BLOCK)  # (BLOCK,)
    for base in range(start, end, BLOCK):
        idx = base + offs  # (BLOCK,)
        x = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        upd = x > best_val
        best_val = tl.where(upd, x, best_val)
        best_idx = tl.where(upd, idx, best_idx)
    _store_first_max(best_val, best_idx, part_val_ptr, part_idx_ptr, row, pid_c, num_chunks)


@triton.jit(do_not_specialize=["num_chunks"])
def _first_of_partials_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_chunks,
                              BLOCK_C: tl.constexpr):
    """Per row: the index of the partials' largest value, the lowest index on a tie (chunks are
    in token order, each holding its first maximum)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    base = row.to(tl.int64) * num_chunks
    best_val = tl.full((BLOCK_C,), float("-inf"), tl.float32)
    # NOTE: a row whose partials are all -inf keeps its first chunk's index (its first token).
    best_idx = tl.load(part_idx_ptr + base + offs * 0)
    for c0 in range(0, num_chunks, BLOCK_C):
        c = c0 + offs
        mask = c < num_chunks
        val = tl.load(part_val_ptr + base + c, mask=mask, other=float("-inf"))
        idx = tl.load(part_idx_ptr + base + c, mask=mask, other=0)
        upd = val > best_val  # strictly: the earlier chunk in a lane keeps a tie
        best_val = tl.where(upd, val, best_val)
        best_idx = tl.where(upd, idx, best_idx)
    top = tl.max(best_val, 0)
    first = tl.min(tl.where(best_val == top, best_idx, 9223372036854775807), 0)
    tl.store(out_ptr + row, first)


# NOTE: num_chunks only addresses the partials; not specialising on it avoids recompiles per batch size.
# NOTE: the per-row parameters are views into one packed buffer; their alignment changes with the
# batch size, and specialising on it would compile variants on the request path.
@triton.jit(do_not_specialize=["num_chunks"],
            do_not_specialize_on_alignment=["temp_ptr", "seed_ptr", "step_ptr", "thr_ptr"])
def _gumbel_argmax_kernel(
    logits_ptr, temp_ptr, seed_ptr, step_ptr, hash_ptr, thr_ptr, part_val_ptr, part_idx_ptr,
    vocab, chunk, num_chunks, stride_row,
    HAS_THR: tl.constexpr, PRECISE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    pid_c = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    greedy = t == 0.0
    t = tl.broadcast_to(tl.where(greedy, 1.0, t), (BLOCK,))  # (BLOCK,): div_rn wants equal shapes
    seed = tl.load(seed_ptr + row)  # int64
    step = tl.load(step_ptr + row)  # int64
    key = _mix32(seed.to(tl.uint32) ^ _SEED_SALT)
    key = _mix32(key ^ (seed >> 32).to(tl.uint32))
    key = _mix32(key ^ step.to(tl.uint32))
    key = _mix32(key ^ (step >> 32).to(tl.uint32))
    if HAS_THR:
        thr = tl.load(thr_ptr + row)

    start, end, row_ptr, best_val, best_idx = _chunk(logits_ptr, row, pid_c, vocab, chunk,
                                                     stride_row, BLOCK)
    offs = tl.arange(0, BLOCK)  # (BLOCK,)
    for base in range(start, end, BLOCK):
        idx = base + offs  # (BLOCK,)
        mask = idx < end
        x = tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32)  # (BLOCK,)
        xt = tl.math.div_rn(x, t)  # exact division, as torch's x / temp
        h = tl.load(hash_ptr + idx, mask=mask, other=0).to(tl.uint32, bitcast=True)  # (BLOCK,)
        bits = _mix32(key ^ h)
        u = ((bits >> _U_SHIFT).to(tl.float32) + 0.5) * _U_SCALE  # (BLOCK,) in (0, 1)
        score = xt - _log(-_log(u, PRECISE), PRECISE)
        if HAS_THR:
            score = tl.where(xt < thr, float("-inf"), score)
        score = tl.where(greedy, x, score)
        score = tl.where(mask, score, float("-inf"))
        # Strictly greater: within a lane the earliest index keeps a tie.
        upd = score > best_val
        best_val = tl.where(upd, score, best_val)
        best_idx = tl.where(upd, idx, best_idx)
    _store_first_max(best_val, best_idx, part_val_ptr, part_idx_ptr, row, pid_c, num_chunks)


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                  token_hash: torch.Tensor, thr: torch.Tensor | None = None, *,
                  block: int | None = None, num_chunks: int | None = None) -> torch.Tensor:
    """(B,) int64: per row, argmax_v of logit/T - log(-log u(seed, step, v)) over tokens with logit/T >= thr.

    logits (B, V) float32/bf16/fp16; temperature (B,) float32, 0 = greedy (plain argmax of the logits,
    no noise, thr ignored); seeds, steps (B,) int64; token_hash (V,) int32 = noise.as_int32_bits of
    noise.token_hashes(arange(V)); thr (B,) float32 or None (keep all). `block`/`num_chunks` override
    the launch shape (tests); the result does not depend on them.
    """
    if logits.dim() != 2:
        raise ValueError(f"gumbel_argmax: logits must be (B, V), got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    if token_hash.shape != (vocab,) or token_hash.dtype != torch.int32:
        raise ValueError(f"gumbel_argmax: token_hash must be ({vocab},) int32, got "
                         f"{tuple(token_hash.shape)} {token_hash.dtype}")
    for name, t in (("temperature", temperature), ("seeds", seeds), ("steps", steps), ("thr", thr)):
        if t is not None and t.shape != (batch,):
            raise ValueError(f"gumbel_argmax: {name} must be ({batch},), got {tuple(t.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if batch == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    block, chunk, num_chunks, part_val, part_idx = _partials(logits, block, num_chunks)
    temperature = temperature.to(torch.float32).contiguous()
    thr = thr.to(torch.float32).contiguous() if thr is not None else None
    _gumbel_argmax_kernel[(batch, num_chunks)](
        logits, temperature, seeds.to(torch.int64).contiguous(), steps.to(torch.int64).contiguous(),
        token_hash.contiguous(), thr if thr is not None else temperature, part_val, part_idx,
        vocab, chunk, num_chunks, logits.stride(0),
        HAS_THR=thr is not None, PRECISE=is_gpu(logits), BLOCK=block, num_warps=_NUM_WARPS,
    )
    return _first_of_partials(part_val, part_idx)


def argmax_rows(logits: torch.Tensor, *, block: int | None = None,
                num_chunks: int | None = None) -> torch.Tensor:
    """(B,) int64: torch.argmax(logits, dim=-1) for (B, V) float logits without NaNs (the lowest
    index wins a tie), over the whole GPU: each row's vocabulary in chunks, then one program a
    row over the chunks' maxima. `block`/`num_chunks` override the launch shape (tests)."""
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows: logits must be (B, V), got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if batch == 0 or vocab == 0:
        if vocab == 0 and batch:
            raise ValueError("argmax_rows: a row without tokens has no argmax")
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    block, chunk, num_chunks, part_val, part_idx = _partials(logits, block, num_chunks)
    _argmax_chunks_kernel[(batch, num_chunks)](
        logits, part_val, part_idx, vocab, chunk, num_chunks, logits.stride(0), BLOCK=block,
        num_warps=_NUM_WARPS)
    return _first_of_partials(part_val, part_idx)


def _partials(logits: torch.Tensor, block: int | None, num_chunks: int | None):
    """The launch shape over (B, V) logits and its (B, chunks) partial maxima and indices:
    (block, chunk, num_chunks, part_val, part_idx)."""
    batch, vocab = logits.shape
    block = block or min(_MAX_BLOCK, next_pow2(vocab))
    blocks = triton.cdiv(vocab, block)
    if num_chunks is None:
        num_chunks = triton.cdiv(_PROGRAMS_PER_SM * num_sms(logits.device), batch)
    chunk = triton.cdiv(blocks, max(1, min(num_chunks, blocks))) * block  # a multiple of block
    num_chunks = triton.cdiv(vocab, chunk)
    part_val = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)  # (B, C)
    part_idx = torch.empty(batch, num_chunks, dtype=torch.int64, device=logits.device)  # (B, C)
    return block, chunk, num_chunks, part_val, part_idx


def _first_of_partials(part_val: torch.Tensor, part_idx: torch.Tensor) -> torch.Tensor:
    """(B,) the index of each row's largest partial, the lowest on a tie."""
    batch, num_chunks = part_val.shape
    if num_chunks == 1:
        return part_idx.view(batch)
    # NOTE: chunks are in token order and each holds its first maximum, so the lowest index wins.
    out = torch.empty(batch, dtype=torch.int64, device=part_val.device)
    _first_of_partials_kernel[(batch,)](part_val, part_idx, out, num_chunks, BLOCK_C=_BLOCK_C,
                                        num_warps=_NUM_WARPS)
    return out
