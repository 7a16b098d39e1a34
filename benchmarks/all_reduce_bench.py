"""Tensor-parallel all-reduce latency on the GPUs of one host: the one-shot kernel over peer
memory against NCCL, per call, for the message sizes of decode steps.

    python benchmarks/all_reduce_bench.py --world 2 --out /tmp/out/all_reduce.json

Each rank captures CALLS all-reduces of one bf16 message in a CUDA graph (as the decode graphs
hold them) and replays it; a call's time is the replay's time over CALLS (median of REPEATS).
Both ranks replay together, so a call's time includes waiting for the other rank. --world 1
times the kernel's own sequence on one GPU (it then waits only for its own flag) against a
trivial in-place kernel on the same message (the `nccl` column)."""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# elements: Llama-3-8B / Llama-2-70B hidden sizes at 1, 8, 64 and 256 rows
SIZES = [4096, 8192, 4096 * 8, 8192 * 8, 4096 * 64, 8192 * 64, 4096 * 256, 8192 * 256]
CALLS = 200
REPEATS = 7


def _rank(rank: int, world: int, port: int, results) -> None:
    try:
        import torch
        import torch.distributed as dist

        from peregrine import distributed as pd
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        pd.init_worker_group(rank, world, store, device)
        peer = pd._PEER if world > 1 else _one_gpu_peer(device)
        rows = []
        for n in SIZES:
            x = torch.randn(n, device=device).bfloat16()
            for way in ("peer", "nccl"):
                if way == "peer" and (peer is None or not peer.fits(x)):
                    continue

                def call(t):
                    if way == "peer":
                        return peer.all_reduce(t)
                    return dist.all_reduce(t) if world > 1 else t.add_(0)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        call(x)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(CALLS):
                        call(x)
                times = []
                for _ in range(REPEATS):
                    dist.barrier()
                    torch.cuda.synchronize()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    graph.replay()
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b) * 1e3 / CALLS)
                times.sort()
                rows.append({"elements": n, "bytes": n * 2, "way": way,
                             "us_per_call": times[len(times) // 2]})
                del graph
        if rank == 0:
            results.put(rows)
        dist.barrier()
    except BaseException:  # noqa: BLE001
        results.put(traceback.format_exc())
    finally:
        results.close()
        results.join_thread()
        os._exit(0)


def _one_gpu_peer(device):
    """The peer all-reduce of a one-rank group: its own buffer and signals only."""
    from peregrine.cuda_ipc import cuda_runtime
    from peregrine.kernels.all_reduce import MAX_PROGRAMS
    from peregrine.peer_all_reduce import SLOT_BYTES, PeerAllReduce
    rt = cuda_runtime()
    mapped = [(rt.malloc_zeroed(2 * SLOT_BYTES), rt.malloc_zeroed(MAX_PROGRAMS * 8))]
    return PeerAllReduce(0, 1, device, mapped, SLOT_BYTES)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ns.world, port, results))
             for r in range(ns.world)]
    for p in procs:
        p.start()
    got = results.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if isinstance(got, str):
        print(got)
        return 1
    print(f"{'elements':>9} {'KiB':>7} {'peer us':>8} {'nccl us':>8}")
    by = {(r["elements"], r["way"]): r["us_per_call"] for r in got}
    for n in SIZES:
        peer, nccl = by.get((n, "peer")), by.get((n, "nccl"))
        print(f"{n:9d} {n * 2 / 1024:7.0f} {peer if peer is None else round(peer, 2)!s:>8} "
              f"{nccl if nccl is None else round(nccl, 2)!s:>8}")
    if ns.out:
        Path(ns.out).write_text(json.dumps({"world": ns.world, "calls": CALLS, "rows": got},
                                           indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
