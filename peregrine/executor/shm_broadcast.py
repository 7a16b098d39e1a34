"""One writer, several readers: messages broadcast through a ring of shared-memory slots.

The writer copies each message into the ring once and every reader copies it out of the same
slots, so a message costs one pickle and one copy per reader whatever the number of readers. A
message larger than a slot spans several consecutive slots. Each slot carries a stamp (its chunk's
sequence number + 1), written after its payload; readers wait for the stamp they expect, then
acknowledge by advancing a counter of their own. The writer reuses a slot only after every
reader has moved past it. The ring carries no notification: the caller tells readers a message
is coming (the executor sends one byte down each worker's pipe, which also tells a worker when the
driver has gone).

Layout: `num_readers` int64 read counters, then `num_slots` slots of
(int64 stamp, int64 message length, payload).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np

_WORD = 8
_HEADER = 2 * _WORD  # stamp, message length


class RingTimeoutError(TimeoutError):
    """The other side of the ring did not move in time."""


def _backoff(pause: float) -> float:
    time.sleep(pause)
    return min(pause * 2, 1e-3)


class ShmRing:
    """A broadcast ring in a named shared-memory segment (created by the writer, attached by name
    in the readers)."""

    def __init__(self, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20,
                 name: str | None = None) -> None:
        if num_readers < 1 or num_slots < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs >= 1 reader, slot and byte, got num_readers="
                             f"{num_readers}, num_slots={num_slots}, slot_bytes={slot_bytes}")
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        self._base = _WORD * num_readers
        self._stride = _HEADER + slot_bytes
        self.is_writer = name is None
        if self.is_writer:
            self._shm = shared_memory.SharedMemory(create=True,
                                                   size=self._base + num_slots * self._stride)
        else:
            # NOTE: Python < 3.13 registers an attached segment with the resource tracker again.
            # Readers are the writer's spawned children and share its tracker, where the name is
            # already registered; the writer's unlink unregisters it once.
            self._shm = shared_memory.SharedMemory(name=name)
        self.name = self._shm.name
        self._acks = np.ndarray((num_readers,), np.int64, self._shm.buf, 0)  # (R,)
        self._stamps = np.ndarray((num_slots,), np.int64, self._shm.buf, self._base,
                                  (self._stride,))  # (S,) strided over the slots
        if self.is_writer:
            self._acks[:] = 0
            self._stamps[:] = 0
        self._chunks = 0  # chunks written (writer) or read (reader)

    def spec(self) -> tuple[str, int, int, int]:
        """What a reader passes to `ShmRing.attach`."""
        return self.name, self.num_readers, self.num_slots, self.slot_bytes

    @classmethod
    def attach(cls, spec: tuple[str, int, int, int]) -> ShmRing:
        name, num_readers, num_slots, slot_bytes = spec
        return cls(num_readers, num_slots, slot_bytes, name=name)

    # ---- writer ---------------------------------------------------------------------------
    def write(self, data: bytes, notify: Callable[[], None] = lambda: None,
              wait: Callable[[], None] = lambda: None, timeout: float | None = None) -> None:
        """Broadcast `data`. `notify` runs once its first chunk is in the ring (readers may start);
        `wait` runs while a slot is still being read (it may raise, e.g. when a reader died)."""
        if not self.is_writer:
            raise RuntimeError("only the ring's creator writes to it")
        buf, n = self._shm.buf, len(data)
        deadline = None if timeout is None else time.monotonic() + timeout
        start = 0
        while True:
            seq = self._chunks
            pause = 1e-5
            # NOTE: the slot's previous chunk is seq - num_slots: every reader must be past it.
            while int(self._acks.min()) <= seq - self.num_slots:
                wait()
                if deadline is not None and time.monotonic() > deadline:
                    raise RingTimeoutError(f"the ring's readers freed no slot in {timeout} s")
                pause = _backoff(pause)
            part = data[start:start + self.slot_bytes]
            off = self._base + (seq % self.num_slots) * self._stride
            buf[off + _WORD:off + _HEADER] = n.to_bytes(_WORD, "little")
            buf[off + _HEADER:off + _HEADER + len(part)] = part
            self._stamps[seq % self.num_slots] = seq + 1  # written last: the chunk is complete
            self._chunks = seq + 1
            if start == 0:
                notify()
            start += len(part)
            if start >= n:
                return

    # ---- reader ---------------------------------------------------------------------------
    def read(self, reader: int, wait: Callable[[], None] = lambda: None,
             timeout: float | None = None) -> bytes:
        """The next message for `reader`, acknowledging each chunk as it is copied out; `wait`
        runs while a chunk is not written yet (it may raise)."""
        out = bytearray()
        total = None
        deadline = None if timeout is None else time.monotonic() + timeout
        while total is None or len(out) < total:
            seq = self._chunks
            slot = seq % self.num_slots
            pause = 1e-5
            while int(self._stamps[slot]) != seq + 1:
                wait()
                if deadline is not None and time.monotonic() > deadline:
                    raise RingTimeoutError(f"no message reached the ring in {timeout} s")
                pause = _backoff(pause)
            off = self._base + slot * self._stride
            buf = self._shm.buf
            if total is None:
                total = int.from_bytes(buf[off + _WORD:off + _HEADER], "little")
            take = min(self.slot_bytes, total - len(out))
            out += buf[off + _HEADER:off + _HEADER + take]
            self._chunks = seq + 1
            self._acks[reader] = seq + 1
            if total == 0:
                break
        return bytes(out)

    def close(self) -> None:
        """Detach; the writer also removes the segment. Safe to call twice."""
        if self._shm is None:
            return
        # NOTE: live views of the buffer would make close() fail.
        del self._acks, self._stamps
        shm, self._shm = self._shm, None
        shm.close()
        if self.is_writer:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
