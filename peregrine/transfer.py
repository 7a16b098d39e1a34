"""Host->device copies that never wait for the device work already queued.

A copy from pageable memory first waits for everything queued on the stream, so small host arrays
are staged in pinned memory from torch's caching host allocator, which keeps each block until the
copies that read it have run: nothing here blocks the host.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool}


def _pack(arrays: Sequence[np.ndarray], pin: bool) -> tuple[torch.Tensor, list[int]]:
    """One host byte buffer holding every array, and where each starts."""
    offsets, total = [], 0
    for a in arrays:
        # NOTE: 8-byte aligned offsets, so every view keeps its dtype's alignment.
        offsets.append(total)
        total += -(-a.nbytes // 8) * 8
    host = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=pin)
    buf = host.numpy()
    for a, off in zip(arrays, offsets):
        buf[off:off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return host, offsets


def _views(buf: torch.Tensor, arrays: Sequence[np.ndarray], offsets: list[int]) -> list[torch.Tensor]:
    return [buf[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
            for a, off in zip(arrays, offsets)]


def stage(arrays: Sequence[np.ndarray], pin: bool) -> list[torch.Tensor]:
    """Host tensors holding copies of `arrays`, packed in one (pinned if `pin`) buffer."""
    host, offsets = _pack(arrays, pin)
    return _views(host, arrays, offsets)


def upload_packed(arrays: Sequence[np.ndarray], device: torch.device
                  ) -> tuple[torch.Tensor, list[int]]:
    """Small host arrays packed into one byte buffer on `device` (one non-blocking copy), and
    where each starts in it (bytes, 8-byte aligned)."""
    host, offsets = _pack(arrays, pin=device.type == "cuda")
    return (host if device.type == "cpu" else host.to(device, non_blocking=True)), offsets


def upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Device copies of small host arrays, sent in one non-blocking copy."""
    dev, offsets = upload_packed(arrays, device)
    return _views(dev, arrays, offsets)


def copy_into(dsts: Sequence[torch.Tensor], arrays: Sequence[np.ndarray]) -> None:
    """dsts[i].copy_(arrays[i]) for fixed device buffers (CUDA graphs replay on them)."""
    if not dsts:
        return
    if dsts[0].device.type == "cpu":
        for dst, a in zip(dsts, arrays):
            dst.copy_(torch.from_numpy(a))
        return
    for dst, src in zip(dsts, stage(arrays, pin=dsts[0].device.type == "cuda")):
        dst.copy_(src, non_blocking=True)


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """One host array on `device` (int64 for lists of ints)."""
    return upload([np.asarray(values)], device)[0]
