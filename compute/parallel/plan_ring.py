"""The channel that carries rank 0's messages (step plans) to the other ranks of a tensor-parallel
group on one host: a ring of bytes in shared memory that rank 0 writes and every other rank
reads at its own pace.

A collective broadcast (gloo's over TCP) returns on the sender only once every receiver has
posted its receive: rank 0 then waited, every step, for the slowest rank to finish launching
the step before, and the ranks' host work ran in lockstep. Through the ring rank 0 writes a
plan and goes on; a rank reads it when its host is free (its GPU still running the step before).

Layout of the mapped file: one 8-byte write position, then one read position per reader, each
on its own 64-byte line, then ``capacity`` bytes of ring. Positions count bytes since the start
and only grow; a message is its 8-byte length then its bytes, padded to 8; one that would run
past the ring's end is placed at its start after a ``WRAP`` length. Positions and lengths are
read and written as aligned 8-byte words (a ``memoryview`` of the mapping cast to ``Q``: one
load or store each). The writer stores the bytes, then the new write position: x86-64 makes
stores visible to other cores in program order, so a reader that sees the position sees the
bytes before it (other CPUs would need a fence here).

Waiting is polling, which turns from spinning into short sleeps after ``SPIN_S``: a rank that
waits for its next plan costs a core for a millisecond, then little. A rank that dies is seen by
the others' processes (``compute.loop.rank``: the group goes down), not here; the writer gives up
on a full ring after ``timeout_s``.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["PlanRing"]

LINE = 64
WRAP = (1 << 64) - 1
SPIN_S = 1e-3
NAP_S = 50e-6


class PlanRing:
    """Rank 0's writing end (``reader`` None) or reader ``reader`` (1 to ``readers``) of the
    ring in the file ``path`` (in ``/dev/shm``); rank 0 creates the file before the others
    open it. ``unlink`` once every rank has it open: the mapping outlives the name."""

    def __init__(
        self,
        path: Path,
        readers: int,
        reader: int | None,
        capacity: int = 8 << 20,
        timeout_s: float = 600.0,
    ) -> None:
        self.path, self.capacity, self.timeout_s = path, capacity, timeout_s
        self.header = LINE * (1 + readers)
        size = self.header + capacity
        if reader is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("Q")  # 8-byte words: one load or store each
        self._reads = [LINE // 8 * r for r in range(1, 1 + readers)]  # word of reader r's position
        self._mine = None if reader is None else self._reads[reader - 1]

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def send(self, payload: bytes) -> None:
        """Writer: appends ``payload``; waits (up to ``timeout_s``) while the slowest reader
        leaves no room for it."""
        size = 8 + len(payload) + (-len(payload) % 8)
        if size > self.capacity // 2:
            raise ValueError(f"a message of {len(payload)} bytes; the ring holds {self.capacity}")
        at = self._words[0]
        offset = at % self.capacity
        skip = self.capacity - offset if offset + size > self.capacity else 0
        end = at + skip + size
        self._wait(lambda: end - min(self._words[r] for r in self._reads) <= self.capacity, "room")
        if skip:
            self._store_length(offset, WRAP)
            offset = 0
        self._store_length(offset, len(payload))
        start = self.header + offset + 8
        self._map[start : start + len(payload)] = payload
        self._words[0] = end  # published: the bytes before it are visible first (x86-64)

    def receive(self) -> bytes:
        """Reader: the next message (waits for it as long as it takes)."""
        mine = self._mine
        assert mine is not None, "rank 0 writes the ring"
        at = self._words[mine]
        self._wait(lambda: self._words[0] > at, None)
        offset = at % self.capacity
        length = self._load_length(offset)
        if length == WRAP:
            at += self.capacity - offset
            offset = 0
            length = self._load_length(0)
        start = self.header + offset + 8
        payload = self._map[start : start + length]
        self._words[mine] = at + 8 + length + (-length % 8)
        return payload

    def _store_length(self, offset: int, length: int) -> None:
        self._words[(self.header + offset) // 8] = length

    def _load_length(self, offset: int) -> int:
        length: int = self._words[(self.header + offset) // 8]
        return length

    def _wait(self, ready: Callable[[], bool], what: str | None) -> None:
        """Polls ``ready()``: spinning for ``SPIN_S``, then napping; ``what`` (the writer's
        wait): TimeoutError after ``timeout_s``."""
        started = time.monotonic()
        while not ready():
            waited = time.monotonic() - started
            if waited < SPIN_S:
                continue
            if what is not None and waited > self.timeout_s:
                raise TimeoutError(f"no {what} in the plan ring for {self.timeout_s:.0f} s")
            time.sleep(NAP_S)
