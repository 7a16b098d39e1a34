"""Kernel timing for the GPU benchmarks: calls captured once in a CUDA graph and replayed, so the
time is the device's, without launch overhead."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def graph_replay_ms(calls: Sequence[Callable[[], object]], iters: int, warmup: int = 1) -> float:
    """Mean ms per replay of one graph that makes every call once, over `iters` replays (each
    call runs once before the capture, so kernels compile outside it)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def write_results(path: str, device: torch.device, results: list) -> None:
    """A probe's results as JSON at path, with the GPU and the torch and triton versions."""
    import json
    from pathlib import Path

    import triton
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"gpu": torch.cuda.get_device_name(device),
                                      "torch": torch.__version__, "triton": triton.__version__,
                                      "results": results}, indent=1))
