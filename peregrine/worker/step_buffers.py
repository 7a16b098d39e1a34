"""Preallocated step buffers: host arrays the step is planned in, and their device twins."""
from __future__ import annotations

import numpy as np
import torch

from peregrine.attention.metadata import AttentionMetadata
from peregrine.models.protocol import PipelineStage
from peregrine.transfer import copy_into, side_stream, upload_packed


class StepBuffers:
    """Host numpy arrays for one step's inputs and fixed-address device copies of them."""

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device,
                 packed: bool | None = None) -> None:
        """packed: send a step's inputs in one copy and write them into the fixed buffers with
        one kernel (kernels/step_inputs.py); None: on a GPU (True on a CPU runs the kernel
        under Triton's interpreter)."""
        def dev(*shape: int, dtype=torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.device = device
        self.packed = device.type == "cuda" if packed is None else packed
        # NOTE: the packed upload runs on a stream of its own, so it is on the device before the
        # step in flight ends rather than queued behind it (and its tokens' copy to the host).
        self.upload_stream = side_stream(device) if self.packed else None
        # NOTE: plain (pageable) host arrays: to_device stages what a step uses in fresh pinned
        # memory, so a step never waits for the previous one's copies before reusing them.
        self.input_ids_np = np.zeros(max_tokens, np.int64)  # (T,)
        self.positions_np = np.zeros(max_tokens, np.int64)  # (T,)
        self.slot_mapping_np = np.zeros(max_tokens, np.int64)  # (T,)
        self.seq_lens_np = np.zeros(max_reqs, np.int32)  # (B,)
        self.query_start_loc_np = np.zeros(max_reqs + 1, np.int32)  # (B + 1,)
        self.block_table_np = np.zeros((max_reqs, max_blocks), np.int32)  # (B, max_blocks)
        # Device copies live at fixed addresses so CUDA graphs can replay on them.
        self.d_input_ids = dev(max_tokens)
        self.d_positions = dev(max_tokens)
        self.d_slot_mapping = dev(max_tokens)
        self.d_seq_lens = dev(max_reqs, dtype=torch.int32)
        self.d_query_start_loc = dev(max_reqs + 1, dtype=torch.int32)
        self.d_block_table = dev(max_reqs, max_blocks, dtype=torch.int32)

    def to_device(self, t: int, b: int, width: int, pad_t: int | None = None,
                  pad_b: int | None = None,
                  pending: tuple[torch.Tensor, int, int, int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Copy the first t tokens / b sequences (width block-table columns) to the device; rows
        up to pad_t / pad_b are padding. pending (sampled (S,) int64 on the device, dst, src, n):
        token ids [dst, dst + n) are sampled[src:src + n] instead of the host's."""
        pt, pb = pad_t or t, pad_b or b
        if pt > t:
            self.slot_mapping_np[t:pt] = -1  # padding tokens write nothing
            self.input_ids_np[t:pt] = 0
            self.positions_np[t:pt] = 0
        if pb > b:
            self.seq_lens_np[b:pb] = 0
            self.query_start_loc_np[b + 1:pb + 1] = self.query_start_loc_np[b]
        qsl = self.query_start_loc_np[:pb + 1].copy()  # (B + 1,)
        seq_lens = self.seq_lens_np[:pb].copy()  # (B,)
        arrays = [self.input_ids_np[:pt], self.positions_np[:pt], self.slot_mapping_np[:pt],
                  seq_lens, qsl, self.block_table_np[:b, :width]]
        if self.packed:
            from peregrine.kernels.step_inputs import scatter_step_inputs
            packed, offsets = upload_packed(arrays, self.device, self.upload_stream)
            scatter_step_inputs(packed, offsets, [
                self.d_input_ids, self.d_positions, self.d_slot_mapping, self.d_seq_lens,
                self.d_query_start_loc, self.d_block_table], pt, pb, b, width, pending)
        else:
            copy_into([self.d_input_ids[:pt], self.d_positions[:pt], self.d_slot_mapping[:pt],
                       self.d_seq_lens[:pb], self.d_query_start_loc[:pb + 1],
                       self.d_block_table[:b, :width]], arrays)
            if pending is not None:
                sampled, dst, src, n = pending
                self.d_input_ids[dst:dst + n].copy_(sampled[src:src + n])
        meta = AttentionMetadata(
            num_actual_tokens=t, num_decodes=0, max_query_len=0, max_seq_len=0,
            query_start_loc=self.d_query_start_loc[:pb + 1], seq_lens=self.d_seq_lens[:pb],
            block_table=self.d_block_table[:pb], slot_mapping=self.d_slot_mapping[:pt],
            query_start_loc_cpu=torch.from_numpy(qsl), seq_lens_cpu=torch.from_numpy(seq_lens))
        return self.d_input_ids[:pt], self.d_positions[:pt], meta


class StageBuffers:
    """A pipeline stage's fixed-address (hidden, residual) exchange with its neighbours, which
    its CUDA graphs read and write: `input(n)` holds the previous stage's, `output(n)` this
    stage's for the next. Each is the start of one flat buffer viewed as a contiguous
    (2, n, hidden), so a step padded to n tokens is one message of exactly that shape (every
    stage pads a step alike: the graph sizes come from the shared configuration)."""

    def __init__(self, stage: PipelineStage, max_tokens: int, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.stage = stage
        self.max_tokens = max_tokens
        self.hidden = hidden
        self.dtype = dtype
        self.device = device
        n = 2 * max_tokens * hidden
        self._in = None if stage.is_first else torch.zeros(n, dtype=dtype, device=device)
        self._out = None if stage.is_last else torch.zeros(n, dtype=dtype, device=device)

    @staticmethod
    def nbytes(stage: PipelineStage, max_tokens: int, hidden: int, dtype: torch.dtype) -> int:
        """Device memory the buffers of such a stage take."""
        return (2 - stage.is_first - stage.is_last) * 2 * max_tokens * hidden * dtype.itemsize

    def input(self, n: int) -> torch.Tensor:
        """(2, n, hidden): the previous stage's hidden states and residual for n tokens."""
        if self._in is None:
            raise RuntimeError("the first pipeline stage has no input from a previous stage")
        return self._view(self._in, n)

    def output(self, n: int) -> torch.Tensor:
        """(2, n, hidden): this stage's hidden states and residual for n tokens."""
        if self._out is None:
            raise RuntimeError("the last pipeline stage has no output for a next stage")
        return self._view(self._out, n)

    def _view(self, flat: torch.Tensor, n: int) -> torch.Tensor:
        if not 0 < n <= self.max_tokens:
            raise ValueError(f"a stage buffer holds 1 to {self.max_tokens} tokens, got {n}")
        return flat[:2 * n * self.hidden].view(2, n, self.hidden)
