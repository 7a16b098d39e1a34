"""One launch of each one-row GEMV at Llama-3-8B's shapes (int4 with zero points, group 128, the
dispatch's default variant; FP8 per channel), for a profiler attached from outside:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section WarpStateStats --section Occupancy --section SchedulerStats \\
        python benchmarks/gemv_ncu.py

Each GEMV runs a few times first (compilation, caches), then once between
cudaProfilerStart/Stop. Prints the order of the profiled launches. Dummy weights."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gemv_bench import _wna16  # noqa: E402
from peregrine.kernels.gemv import w8_gemv  # noqa: E402
from peregrine.kernels.wna16_gemv import wna16_gemv  # noqa: E402
from peregrine.testing import fp8_pack  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}


def main() -> int:
    dev = torch.device("cuda")
    calls = []
    for name, (k, n) in SHAPES.items():
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        w = _wna16(k, n, 4, True, dev)
        calls.append((f"int4 {name}", lambda x=x, w=w: wna16_gemv(x, w)))
        wq, sc = fp8_pack.quantize_per_channel(torch.randn(n, k, device=dev) * 0.02,
                                               torch.float8_e4m3fn)
        sc = sc.t().contiguous()
        calls.append((f"fp8 {name}", lambda x=x, wq=wq, sc=sc: w8_gemv(x, wq, sc)))
    for _, fn in calls:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for label, fn in calls:
        fn()
        torch.cuda.synchronize()
        print("profiled:", label, flush=True)
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
