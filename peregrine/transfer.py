"""Host->device copies that never wait for the device work already queued.

A copy from pageable memory first waits for everything queued on the stream, so small host arrays
are staged in pinned memory from torch's caching host allocator, which keeps each block until the
copies that read it have run: nothing here blocks the host.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# A step's copies run on streams of their own on a GPU (see side_stream): the next step's inputs
# then do not queue behind the step in flight, nor its first kernel behind the copy of the last
# step's tokens to the host.
SIDE_STREAMS = True

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


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A stream for a step's copies on a CUDA device (None elsewhere, or with SIDE_STREAMS off)."""
    return torch.cuda.Stream(device) if device.type == "cuda" and SIDE_STREAMS else None


def upload_packed(arrays: Sequence[np.ndarray], device: torch.device,
                  stream: torch.cuda.Stream | None = None) -> tuple[torch.Tensor, list[int]]:
    """Small host arrays packed into one byte buffer on `device` (one non-blocking copy), and
    where each starts in it (bytes, 8-byte aligned). With `stream` (CUDA), the copy runs there,
    so it does not wait for the work queued on the current stream, and the current stream waits
    for it before its next work."""
    host, offsets = _pack(arrays, pin=device.type == "cuda")
    if device.type == "cpu":
        return host, offsets
    if stream is None:
        return host.to(device, non_blocking=True), offsets
    current = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        dev = host.to(device, non_blocking=True)
    current.wait_stream(stream)
    dev.record_stream(current)  # NOTE: read on the current stream: not reused before that runs
    return dev, offsets


def download(tensors: dict[str, torch.Tensor], device: torch.device,
             stream: torch.cuda.Stream | None = None
             ) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
    """Host copies of device tensors once the work queued so far has run, and a CUDA event
    recorded after the copies (None off CUDA, where the tensors themselves are returned). The
    copies go to pinned memory without blocking the host; with `stream` they run there, after
    the current stream's queued work, so the current stream's next work does not wait for them."""
    if device.type != "cuda":
        return dict(tensors), None
    event = torch.cuda.Event()
    if stream is None or not tensors:
        out = {k: _pinned_copy(x) for k, x in tensors.items()}
        event.record()
        return out, event
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        out = {}
        for k, x in tensors.items():
            x.record_stream(stream)  # NOTE: freed on the current stream, read here
            out[k] = _pinned_copy(x)
        event.record(stream)
    return out, event


def _pinned_copy(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x, non_blocking=True)


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
