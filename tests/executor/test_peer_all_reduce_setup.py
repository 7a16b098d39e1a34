"""How the ranks of a tensor-parallel group agree on the all-reduce over peer memory (two gloo
processes, a stand-in CUDA runtime): every rank maps the others' buffers and uses it, or, when
one rank cannot map a peer's memory or the ranks are on several hosts, every rank falls back to
NCCL and frees what it had allocated."""
from __future__ import annotations

import socket

import pytest

from peregrine.testing.gloo import run_on_gloo_ranks

WORLD = 2


class _FakeRuntime:
    """Allocations are counters; a handle names its rank and address."""

    def __init__(self, rank: int, fail_open: bool) -> None:
        self.rank, self.fail_open = rank, fail_open
        self.live: set[int] = set()
        self.opened: set[int] = set()
        self.next = (rank + 1) << 32

    def malloc_zeroed(self, nbytes: int) -> int:
        self.next += 1 << 20
        self.live.add(self.next)
        return self.next

    def free(self, ptr: int) -> None:
        self.live.remove(ptr)

    def ipc_handle(self, ptr: int) -> bytes:
        return ptr.to_bytes(64, "little")

    def open_ipc_handle(self, handle: bytes) -> int:
        if self.fail_open:
            raise RuntimeError("cudaIpcOpenMemHandle failed: CUDA error 217 (peer access is not "
                               "supported between these two devices)")
        ptr = int.from_bytes(handle, "little") + 7  # mapped elsewhere in this process
        self.opened.add(ptr)
        return ptr

    def close_ipc_handle(self, ptr: int) -> None:
        self.opened.remove(ptr)


def _setup(case: str) -> list[tuple]:
    """On each gloo rank: PeerAllReduce.create with a stand-in runtime; every rank's
    (buffers and signals or None, live allocations, opened handles), gathered."""
    import torch
    import torch.distributed as dist

    import peregrine.cuda_ipc as cuda_ipc
    from peregrine.peer_all_reduce import PeerAllReduce
    rank = dist.get_rank()
    rt = _FakeRuntime(rank, fail_open=(case == "one_rank_cannot_map" and rank == 1))
    cuda_ipc.cuda_runtime = lambda: rt
    if case == "two_hosts":
        socket.gethostname = lambda: f"node{rank}"
    peer = PeerAllReduce.create(dist.group.WORLD, torch.device("cpu"))
    result = None if peer is None else {"buffers": peer.buffers.tolist(),
                                        "signals": peer.signals.tolist()}
    every: list = [None] * WORLD
    dist.all_gather_object(every, (result, sorted(rt.live), sorted(rt.opened)))
    return every


def _run(case: str) -> dict[int, tuple]:
    return dict(enumerate(run_on_gloo_ranks(_setup, WORLD, case)))


def test_every_rank_maps_every_peer() -> None:
    got = _run("all_map")
    base = {r: (r + 1) << 32 for r in range(WORLD)}
    for rank, (result, live, opened) in got.items():
        # own buffer and signals at this rank's addresses, the peer's as mapped here (+7)
        want_bufs = [base[q] + (1 << 20) + (0 if q == rank else 7) for q in range(WORLD)]
        want_sigs = [base[q] + (2 << 20) + (0 if q == rank else 7) for q in range(WORLD)]
        assert result == {"buffers": want_bufs, "signals": want_sigs}
        assert live == [base[rank] + (1 << 20), base[rank] + (2 << 20)]
        assert len(opened) == 2 * (WORLD - 1)


@pytest.mark.parametrize("case", ["one_rank_cannot_map", "two_hosts"])
def test_a_rank_that_cannot_map_sends_every_rank_to_nccl(case: str) -> None:
    got = _run(case)
    for rank, (result, live, opened) in got.items():
        assert result is None, rank
        assert live == [] and opened == [], (rank, live, opened)  # nothing left allocated


def test_the_flag_reaches_the_workers_group_setup(monkeypatch) -> None:
    """--disable-custom-all-reduce turns the peer-memory all-reduce off in every rank's setup."""
    import torch

    import peregrine.distributed as pd
    from peregrine.config import EngineArgs
    from peregrine.executor.worker_setup import build_worker
    from peregrine.testing.checkpoints import tiny_checkpoint
    seen = []

    def fake_init(rank, world, store, device, pipeline_parallel_size=1, peer_all_reduce=True):
        seen.append(peer_all_reduce)
        raise RuntimeError("stop here")
    monkeypatch.setattr(pd, "init_worker_group", fake_init)
    for flag in (False, True):
        config = EngineArgs(model=str(tiny_checkpoint("llama")), device="cpu",
                            disable_custom_all_reduce=flag).create_engine_config()
        assert config.disable_custom_all_reduce is flag
        with pytest.raises(RuntimeError, match="stop here"):
            build_worker(config, 0, 0, None, torch.device("cpu"))
    assert seen == [True, False]
