"""Preallocated step buffers: pinned host arrays (numpy views) and their device twins."""
from __future__ import annotations

import torch

from peregrine.attention.metadata import AttentionMetadata


class StepBuffers:
    """Preallocated pinned host buffers (numpy views) and their device twins for one step."""

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device) -> None:
        pin = device.type == "cuda"

        def host(*shape: int, dtype=torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        def dev(*shape: int, dtype=torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.device = device
        self.input_ids = host(max_tokens)
        self.positions = host(max_tokens)
        self.slot_mapping = host(max_tokens)
        self.seq_lens = host(max_reqs, dtype=torch.int32)
        self.query_start_loc = host(max_reqs + 1, dtype=torch.int32)
        self.block_table = host(max_reqs, max_blocks, dtype=torch.int32)
        self.input_ids_np = self.input_ids.numpy()
        self.positions_np = self.positions.numpy()
        self.slot_mapping_np = self.slot_mapping.numpy()
        self.seq_lens_np = self.seq_lens.numpy()
        self.query_start_loc_np = self.query_start_loc.numpy()
        self.block_table_np = self.block_table.numpy()
        # Device copies live at fixed addresses so CUDA graphs can replay on them.
        self.d_input_ids = dev(max_tokens)
        self.d_positions = dev(max_tokens)
        self.d_slot_mapping = dev(max_tokens)
        self.d_seq_lens = dev(max_reqs, dtype=torch.int32)
        self.d_query_start_loc = dev(max_reqs + 1, dtype=torch.int32)
        self.d_block_table = dev(max_reqs, max_blocks, dtype=torch.int32)

    def to_device(self, t: int, b: int, width: int, pad_t: int | None = None,
                  pad_b: int | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Copy the first t tokens / b sequences to the device; rows up to pad_t/pad_b are padding."""
        pt, pb = pad_t or t, pad_b or b
        if pt > t:
            self.slot_mapping_np[t:pt] = -1  # padding tokens write nothing
            self.input_ids_np[t:pt] = 0
            self.positions_np[t:pt] = 0
        if pb > b:
            self.seq_lens_np[b:pb] = 0
            self.query_start_loc_np[b + 1:pb + 1] = self.query_start_loc_np[b]
        nb = self.device.type == "cuda"
        self.d_input_ids[:pt].copy_(self.input_ids[:pt], non_blocking=nb)
        self.d_positions[:pt].copy_(self.positions[:pt], non_blocking=nb)
        self.d_slot_mapping[:pt].copy_(self.slot_mapping[:pt], non_blocking=nb)
        self.d_seq_lens[:pb].copy_(self.seq_lens[:pb], non_blocking=nb)
        self.d_query_start_loc[:pb + 1].copy_(self.query_start_loc[:pb + 1], non_blocking=nb)
        # NOTE: whole rows, so source and destination are contiguous: a strided host source would
        # go through a pageable temporary, and a pageable copy waits for the in-flight step.
        self.d_block_table[:b].copy_(self.block_table[:b], non_blocking=nb)
        meta = AttentionMetadata(
            num_actual_tokens=t, num_decodes=0, max_query_len=0, max_seq_len=0,
            query_start_loc=self.d_query_start_loc[:pb + 1], seq_lens=self.d_seq_lens[:pb],
            block_table=self.d_block_table[:pb], slot_mapping=self.d_slot_mapping[:pt],
            query_start_loc_cpu=self.query_start_loc[:pb + 1], seq_lens_cpu=self.seq_lens[:pb])
        return self.d_input_ids[:pt], self.d_positions[:pt], meta
