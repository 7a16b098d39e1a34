"""KV block copies between the device's KV cache and the CPU swap space (preemption by swap).

The swap space is one CPU tensor, (num_cpu_blocks, 2 x num_layers, layer_block_bytes) bytes:
a CPU block holds the K and V of every layer for one device block, contiguously, so a run of
consecutive CPU blocks is one host<->device copy. A step's copies are batched: one gather (or
scatter) per K / V tensor per layer over all of the step's blocks, through a device staging
buffer, and one copy per run of consecutive CPU blocks (the CPU pool hands out consecutive ids).

On CUDA the swap space is pinned and every copy is queued without waiting, on the current stream:
a swap-out is ordered after the step still in flight that wrote the KV it copies, and before the
step that reuses the freed device blocks; a swap-in lands before the step that reads it. A side
stream would buy nothing: the next forward must wait for the copies either way.
"""
from __future__ import annotations

import logging
import weakref

import numpy as np
import torch

from peregrine.transfer import to_device
from peregrine.worker.cuda_graphs import KVCaches
from peregrine.worker.kv_memory import _untouched_zeros

logger = logging.getLogger("peregrine")

# A step's copies go through device staging buffers of at most this many bytes at a time. It runs
# before the forward, so it fits in the activation memory the KV sizing left out.
MAX_STAGING_BYTES = 256 << 20


class KVSwapSpace:
    """The CPU swap space of one worker and the copies in and out of its KV cache."""

    def __init__(self, kv_caches: KVCaches, num_cpu_blocks: int, device: torch.device) -> None:
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.device = device
        # Every K and V cache seen as (num_blocks, layer_block_bytes) bytes.
        self._flat = [c.view(torch.uint8).view(c.shape[0], -1) for pair in kv_caches for c in pair]
        sizes = {f.shape[1] for f in self._flat}
        if len(sizes) > 1:
            raise ValueError(f"swapping needs equal block sizes in every layer, got {sorted(sizes)}")
        self.layer_block_bytes = sizes.pop() if sizes else 0
        self.num_cpu_blocks = num_cpu_blocks
        shape = (num_cpu_blocks, len(self._flat), self.layer_block_bytes)
        if num_cpu_blocks == 0:
            self.cpu = torch.empty((0, *shape[1:]), dtype=torch.uint8)
        elif device.type == "cuda":
            self.cpu = self._pinned(shape)
        else:
            # NOTE: plain, lazily mapped memory on a CPU run, where a "swap" is a memcpy; the same
            # code path as on CUDA, so the CPU tests exercise it.
            self.cpu = _untouched_zeros(shape, torch.uint8)
        self.block_bytes = len(self._flat) * self.layer_block_bytes
        self._chunk = max(1, MAX_STAGING_BYTES // max(1, self.block_bytes))

    def _pinned(self, shape: tuple[int, int, int]) -> torch.Tensor:
        """Page-locked memory of exactly this size.

        NOTE: torch's pinned allocator rounds every allocation up to a power of two (5 GiB would
        lock 8), so the pages are mapped, then registered with CUDA, and unregistered when this
        swap space is dropped.
        """
        cpu = _untouched_zeros(shape, torch.uint8)
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(cpu.data_ptr(), cpu.numel(), 1))  # 1: portable
        if err != 0:
            logger.warning("registering %.2f GiB of swap space with CUDA failed (error %d): "
                           "allocating it pinned instead", cpu.numel() / 2**30, err)
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        weakref.finalize(self, _unregister, cpu)
        return cpu

    def swap_out(self, copies: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks: (device block, CPU block) pairs."""
        if not copies:
            return
        pairs = self._sorted_pairs(copies, cpu_col=1)  # (n, 2), by CPU block
        for a in range(0, len(pairs), self._chunk):
            chunk = pairs[a:a + self._chunk]
            src = to_device(np.ascontiguousarray(chunk[:, 0]), self.device)  # (c,)
            staging = torch.stack([f.index_select(0, src) for f in self._flat], dim=1)  # (c, 2L, B)
            for lo, hi in _runs(chunk[:, 1]):
                start = int(chunk[lo, 1])
                self.cpu[start:start + hi - lo].copy_(staging[lo:hi], non_blocking=True)

    def swap_in(self, copies: list[tuple[int, int]]) -> None:
        """Copy CPU blocks to device blocks: (CPU block, device block) pairs."""
        if not copies:
            return
        pairs = self._sorted_pairs(copies, cpu_col=0)  # (n, 2), by CPU block
        for a in range(0, len(pairs), self._chunk):
            chunk = pairs[a:a + self._chunk]
            staging = torch.empty((len(chunk), len(self._flat), self.layer_block_bytes),
                                  dtype=torch.uint8, device=self.device)  # (c, 2L, B)
            for lo, hi in _runs(chunk[:, 0]):
                start = int(chunk[lo, 0])
                staging[lo:hi].copy_(self.cpu[start:start + hi - lo], non_blocking=True)
            dst = to_device(np.ascontiguousarray(chunk[:, 1]), self.device)  # (c,)
            for j, f in enumerate(self._flat):
                f.index_copy_(0, dst, staging[:, j])

    def _sorted_pairs(self, copies: list[tuple[int, int]], cpu_col: int) -> np.ndarray:
        pairs = np.asarray(copies, dtype=np.int64).reshape(-1, 2)  # (n, 2)
        cpu = pairs[:, cpu_col]
        if cpu.min() < 0 or cpu.max() >= self.num_cpu_blocks:
            raise ValueError(f"CPU block ids must be in [0, {self.num_cpu_blocks}), got "
                             f"{cpu.min()}..{cpu.max()}")
        num_dev = self._flat[0].shape[0]
        dev = pairs[:, 1 - cpu_col]
        if dev.min() < 0 or dev.max() >= num_dev:
            raise ValueError(f"device block ids must be in [0, {num_dev}), got "
                             f"{dev.min()}..{dev.max()}")
        return pairs[np.argsort(cpu, kind="stable")]


def _unregister(cpu: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(cpu.data_ptr())


def _runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """[lo, hi) index ranges of `ids` (sorted) whose values are consecutive."""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    bounds = np.concatenate(([0], breaks, [len(ids)])).tolist()
    return list(zip(bounds[:-1], bounds[1:]))
