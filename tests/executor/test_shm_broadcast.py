"""ShmRing: one writer, several readers, messages of any size through fixed shared-memory slots."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import threading

import pytest

from peregrine.executor.shm_broadcast import RingTimeoutError, ShmRing


def _segment_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name.lstrip('/')}")


def test_every_reader_gets_every_message_in_order_across_wraps() -> None:
    ring = ShmRing(num_readers=2, num_slots=3, slot_bytes=64)
    readers = [ShmRing.attach(ring.spec()) for _ in range(2)]
    msgs = [bytes([i]) * (i * 7 % 50) for i in range(20)]  # 20 messages wrap 3 slots many times
    for m in msgs:
        ring.write(m)
        assert [r.read(i) for i, r in enumerate(readers)] == [m, m]
    for r in readers:
        r.close()
    ring.close()


def test_a_message_larger_than_a_slot_spans_slots_while_a_reader_drains_them() -> None:
    ring = ShmRing(num_readers=1, num_slots=2, slot_bytes=16)
    reader = ShmRing.attach(ring.spec())
    big = bytes(range(256)) * 3  # 768 bytes: 48 chunks through 2 slots
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(reader.read(0, timeout=30)))
    t.start()
    ring.write(big, timeout=30)
    t.join(30)
    assert got == [big]
    ring.write(b"")
    assert reader.read(0) == b""
    reader.close()
    ring.close()


def test_the_writer_waits_for_the_slowest_reader() -> None:
    ring = ShmRing(num_readers=2, num_slots=2, slot_bytes=8)
    fast, slow = ShmRing.attach(ring.spec()), ShmRing.attach(ring.spec())
    ring.write(b"a")
    ring.write(b"b")
    assert fast.read(0) == b"a" and fast.read(0) == b"b"
    with pytest.raises(RingTimeoutError):
        ring.write(b"c", timeout=0.05)  # the slow reader still holds slot 0
    assert slow.read(1) == b"a"
    ring.write(b"c", timeout=1.0)
    assert slow.read(1) == b"b" and slow.read(1) == b"c" and fast.read(0) == b"c"
    fast.close(); slow.close(); ring.close()


def test_a_reader_waiting_for_an_unwritten_message_times_out() -> None:
    ring = ShmRing(num_readers=1, num_slots=2, slot_bytes=8)
    reader = ShmRing.attach(ring.spec())
    with pytest.raises(RingTimeoutError):
        reader.read(0, timeout=0.05)
    reader.close(); ring.close()


def _read_in_child(spec: tuple, reader: int, n: int, conn) -> None:
    ring = ShmRing.attach(spec)
    conn.send([pickle.loads(ring.read(reader, timeout=30)) for _ in range(n)])
    ring.close()


def test_readers_in_other_processes_read_the_one_copy_and_the_writer_unlinks_it() -> None:
    ctx = multiprocessing.get_context("spawn")
    ring = ShmRing(num_readers=2, num_slots=4, slot_bytes=1024)
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_read_in_child, args=(ring.spec(), i, 10, pipes[i][1]))
             for i in range(2)]
    for p in procs:
        p.start()
    msgs = [{"step": i, "ids": list(range(i * 100))} for i in range(10)]  # some span slots
    for m in msgs:
        ring.write(pickle.dumps(m), timeout=60)
    assert [pipes[i][0].recv() for i in range(2)] == [msgs, msgs]
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    name = ring.name
    assert _segment_exists(name)
    ring.close()
    ring.close()
    assert not _segment_exists(name)


def test_bad_sizes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="num_readers=0"):
        ShmRing(num_readers=0)
