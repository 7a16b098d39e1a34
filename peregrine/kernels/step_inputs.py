"""A step's inputs from one packed upload into the fixed device buffers CUDA graphs replay on.

The host packs a step's token ids, positions, slot mapping, sequence lengths, query start
locations and block table into one buffer, which reaches the device in one copy; this kernel
then writes each section into its fixed buffer, and the tokens sampled on the device by the step
still in flight over their placeholders in the token ids. One copy and one kernel, where a copy
per buffer and one more for the sampled tokens each took their own turn on the stream.

Everything is moved as 32-bit words: an int64 array is two words an element.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from peregrine.kernels._utils import reusable_launch

# The fixed buffers, in the order the packed upload holds them (the block table last).
SECTIONS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
            "block_table")
_BLOCK = 1024
_PROGRAMS_PER_SECTION = 4


@triton.jit
def _copy_words(dst_ptr, src_ptr, n, pid, nprog, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        i = start + offs
        mask = i < n
        tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=mask), mask=mask)


# NOTE: no argument is specialized on its value or alignment, so one compiled kernel serves
# every step and its launch can be reused with new arguments (scatter_step_inputs).
_RUNTIME_ARGS = ["src_ptr", "sampled_ptr", "tok_words", "seq_words", "qsl_words", "bt_rows",
                 "bt_cols", "bt_stride", "off_pos", "off_slot", "off_seq", "off_qsl", "off_bt",
                 "pend_dst", "pend_src", "pend_n"]


@triton.jit(do_not_specialize=_RUNTIME_ARGS)
def _step_inputs_kernel(
    src_ptr, sampled_ptr,
    ids_ptr, pos_ptr, slot_ptr, seq_ptr, qsl_ptr, bt_ptr,
    tok_words, seq_words, qsl_words, bt_rows, bt_cols, bt_stride,
    off_pos, off_slot, off_seq, off_qsl, off_bt,
    pend_dst, pend_src, pend_n,
    BLOCK: tl.constexpr,
):
    section = tl.program_id(0)
    pid = tl.program_id(1)
    nprog = tl.num_programs(1)
    offs = tl.arange(0, BLOCK)
    if section == 0:
        # Token ids (words [0, tok_words) of the upload); the elements [pend_dst, pend_dst +
        # pend_n) take the sampled tokens [pend_src, pend_src + pend_n) instead.
        for start in range(pid * BLOCK, tok_words, nprog * BLOCK):
            w = start + offs
            mask = w < tok_words
            e = w // 2
            pending = mask & (e >= pend_dst) & (e < pend_dst + pend_n)
            from_sampled = tl.load(sampled_ptr + (e - pend_dst + pend_src) * 2 + w % 2,
                                   mask=pending)
            from_host = tl.load(src_ptr + w, mask=mask & ~pending)
            tl.store(ids_ptr + w, tl.where(pending, from_sampled, from_host), mask=mask)
    elif section == 1:
        _copy_words(pos_ptr, src_ptr + off_pos, tok_words, pid, nprog, BLOCK)
    elif section == 2:
        _copy_words(slot_ptr, src_ptr + off_slot, tok_words, pid, nprog, BLOCK)
    elif section == 3:
        _copy_words(seq_ptr, src_ptr + off_seq, seq_words, pid, nprog, BLOCK)
    elif section == 4:
        _copy_words(qsl_ptr, src_ptr + off_qsl, qsl_words, pid, nprog, BLOCK)
    else:
        # The block table's first bt_rows rows, bt_cols words each, into rows bt_stride apart.
        n = bt_rows * bt_cols
        for start in range(pid * BLOCK, n, nprog * BLOCK):
            k = start + offs
            mask = k < n
            row = k // bt_cols
            col = k - row * bt_cols
            tl.store(bt_ptr + row.to(tl.int64) * bt_stride + col,
                     tl.load(src_ptr + off_bt + k, mask=mask), mask=mask)


# Compiled launches by device and buffers (None: launch through the JIT).
_launches: dict = {}


def _words(x: torch.Tensor) -> torch.Tensor:
    """x (int64 or int32, contiguous rows) viewed as int32 words."""
    if x.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"step inputs are int64 or int32, got {x.dtype}")
    return x.view(torch.int32)


def scatter_step_inputs(packed: torch.Tensor, offsets: list[int], dsts: list[torch.Tensor],
                        num_tokens: int, num_seqs: int, bt_rows: int, bt_cols: int,
                        pending: tuple[torch.Tensor, int, int, int] | None = None) -> None:
    """Write a packed upload's sections into the step's fixed device buffers.

    packed: the upload's bytes (uint8, a multiple of 8); offsets: where each section of SECTIONS
    starts in it (bytes, 8-aligned); dsts: the six fixed buffers in SECTIONS' order, each whole
    (the block table 2-D, int32; the others 1-D). The first num_tokens token ids, positions and
    slots, num_seqs sequence lengths, num_seqs + 1 query start locations and bt_rows × bt_cols
    block-table entries are written. pending (sampled (S,) int64, dst, src, n): token ids [dst,
    dst + n) take sampled[src:src + n]."""
    if len(dsts) != len(SECTIONS) or len(offsets) != len(SECTIONS):
        raise ValueError(f"expected {len(SECTIONS)} buffers and offsets, got {len(dsts)} and "
                         f"{len(offsets)}")
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() % 8:
        raise ValueError("packed must be a 1-D uint8 buffer of whole 8-byte words")
    if any(off % 8 for off in offsets):
        raise ValueError(f"section offsets must be 8-byte aligned, got {offsets}")
    ids, pos, slots, seq_lens, qsl, bt = dsts
    if bt.dim() != 2 or bt.dtype != torch.int32 or bt.stride(1) != 1:
        raise ValueError("the block table must be a 2-D int32 buffer with contiguous rows")
    if not (num_tokens <= ids.numel() and num_seqs + 1 <= qsl.numel()
            and bt_rows <= bt.shape[0] and bt_cols <= bt.shape[1]):
        raise ValueError("a section is larger than its buffer")
    if pending is None:
        sampled, p_dst, p_src, p_n = ids, 0, 0, 0
    else:
        sampled, p_dst, p_src, p_n = pending
        if sampled.dtype != torch.int64 or not sampled.is_contiguous():
            raise ValueError("sampled tokens must be a contiguous int64 tensor")
        if p_n < 0 or p_dst + p_n > num_tokens or p_src + p_n > sampled.numel():
            raise ValueError(f"pending tokens [{p_dst}, {p_dst + p_n}) from [{p_src}, "
                             f"{p_src + p_n}) do not fit")
    if ids.dtype != torch.int64 or pos.dtype != torch.int64 or slots.dtype != torch.int64:
        raise ValueError("token ids, positions and slots must be int64")
    seq_w = num_seqs * (seq_lens.element_size() // 4)
    qsl_w = (num_seqs + 1) * (qsl.element_size() // 4)
    runtime = (packed.view(torch.int32), _words(sampled), 2 * num_tokens, seq_w, qsl_w,
               bt_rows, bt_cols, bt.stride(0), *(off // 4 for off in offsets[1:]), p_dst, p_src,
               p_n)
    buffers = tuple(_words(x) for x in (ids, pos, slots, seq_lens, qsl)) + (bt,)
    key = (packed.device, *(x.data_ptr() for x in buffers), *(x.dtype for x in buffers))
    hit = _launches.get(key) if packed.device.type == "cuda" else None
    if hit is not None:
        launcher, values = hit
        values[0:2] = runtime[0:2]
        values[8:8 + len(runtime) - 2] = runtime[2:]
        try:
            launcher(*values)
            return
        except TypeError:
            # NOTE: a Triton whose compiled launcher takes other arguments refuses them before
            # launching anything: launch through the JIT from now on.
            _launches.clear()
            _launches[None] = None
    args = (*runtime[0:2], *buffers, *runtime[2:])
    grid = (len(SECTIONS), _PROGRAMS_PER_SECTION)
    if packed.device.type != "cuda" or None in _launches:
        _step_inputs_kernel[grid](*args, BLOCK=_BLOCK, num_warps=4)
        return
    launch = reusable_launch(_step_inputs_kernel, grid, args, dict(BLOCK=_BLOCK),
                             dict(num_warps=4))
    if launch is not None:
        _launches[key] = launch
