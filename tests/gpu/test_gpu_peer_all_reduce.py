"""The one-shot all-reduce over peer GPU memory on two GPUs: every size up to a slot and every
16/32-bit dtype gives, on both ranks, the bits of the rank-ordered float32 sum rounded once;
calls of different sizes back to back and inside a replayed CUDA graph stay correct (the call
count and the two buffer halves); larger messages go through NCCL."""
from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs"),
]

WORLD = 2
SIZES = [1, 7, 1024, 4096, 4097, 65536, 8192 * 37, 1 << 20]  # elements; 1 << 20 fp32 = 4 MiB


def _reference(x: torch.Tensor, group) -> torch.Tensor:
    """The rank-ordered float32 sum of every rank's x, rounded once to x's dtype."""
    import torch.distributed as dist
    parts = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(parts, x, group=group)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for p in parts:
        acc += p.float()
    return acc.to(x.dtype)


def _checks(rank: int, port: int, errors) -> None:
    try:
        import torch.distributed as dist

        from peregrine import distributed as pd
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0)
        pd.init_worker_group(rank, WORLD, store, device)
        peer, group = pd._PEER, pd._TP_GROUP
        assert peer is not None, "peer memory was not mapped"
        g = torch.Generator(device=device).manual_seed(1000 + rank)
        # every size and dtype, twice over (both buffer halves), each checked
        for rep in range(2):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                for n in SIZES:
                    if n * torch.tensor([], dtype=dtype).element_size() > peer.slot_bytes:
                        continue
                    x = torch.randn(n, generator=g, device=device).to(dtype)
                    want = _reference(x, group)
                    got = pd.tp_all_reduce(x.clone())
                    assert torch.equal(got, want), (rep, dtype, n)
        # a message over a slot goes through NCCL and still sums
        big = torch.randn(peer.slot_bytes // 2 + 8, generator=g, device=device).bfloat16()
        assert not peer.fits(big)
        assert torch.equal(pd.tp_all_reduce(big.clone()), _reference(big, group))
        # many calls of alternating sizes with no host sync between them
        xs = [torch.randn(n, generator=g, device=device).bfloat16()
              for n in (4096, 300000, 4096, 17, 65536) * 20]
        wants = [_reference(x, group) for x in xs]
        gots = [pd.tp_all_reduce(x.clone()) for x in xs]
        for i, (got, want) in enumerate(zip(gots, wants)):
            assert torch.equal(got, want), i
        # inside a CUDA graph, replayed with new inputs
        bufs = [torch.zeros(n, device=device, dtype=torch.bfloat16) for n in (4096, 8192 * 8)]
        outs = [b.clone() for b in bufs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b, o in zip(bufs, outs):  # warm-up outside the capture
                o.copy_(b)
                pd.tp_all_reduce(o)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(3):
                for b, o in zip(bufs, outs):
                    o.copy_(b)
                    pd.tp_all_reduce(o)
        for _ in range(30):
            for b in bufs:
                b.copy_(torch.randn(b.shape, generator=g, device=device))
            graph.replay()
            for b, o in zip(bufs, outs):
                assert torch.equal(o, _reference(b, group))
        torch.cuda.synchronize()
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put((rank, traceback.format_exc()))
    finally:
        errors.close()
        errors.join_thread()  # the report reaches the parent before the process ends
        os._exit(0)


def test_one_shot_all_reduce_matches_the_rank_ordered_sum_on_both_gpus() -> None:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_checks, args=(r, port, errors)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not alive, f"ranks did not finish (a hang): {alive}; {found}"
    assert not found, "\n".join(f"rank {r}:\n{tb}" for r, tb in found)
