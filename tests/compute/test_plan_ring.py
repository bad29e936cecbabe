"""The plan ring of a tensor-parallel group (``compute.parallel.plan_ring``): messages reach every
reader whole and in order, across the ring's end, between processes; the writer waits for the
slowest reader and gives up on a full ring after its timeout."""

from __future__ import annotations

import hashlib
import multiprocessing
import random
from pathlib import Path

import pytest

from compute.parallel.plan_ring import PlanRing


def messages(seed: int, n: int, largest: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.randrange(largest)) for _ in range(n)]


def test_every_reader_gets_every_message_in_order_across_the_ring_end(tmp_path: Path) -> None:
    path = tmp_path / "ring"
    writer = PlanRing(path, 2, None, capacity=8192)
    readers = [PlanRing(path, 2, r, capacity=8192) for r in (1, 2)]
    writer.unlink()  # the mappings outlive the name
    assert not path.exists()
    sent = messages(1, 400, 1000)  # ~200 KB through 8 KiB: the ring wraps ~25 times
    got: list[list[bytes]] = [[], []]
    for i, payload in enumerate(sent):
        writer.send(payload)
        for r, reader in enumerate(readers):
            while len(got[r]) < i + 1 - r:  # reader 1 keeps up, reader 2 lags one behind
                got[r].append(reader.receive())
    for r, reader in enumerate(readers):
        got[r] += [reader.receive() for _ in range(len(sent) - len(got[r]))]
        assert got[r] == sent


def test_the_writer_waits_for_the_slowest_reader_then_gives_up(tmp_path: Path) -> None:
    path = tmp_path / "ring"
    writer = PlanRing(path, 2, None, capacity=1024, timeout_s=0.2)
    fast, slow = PlanRing(path, 2, 1, capacity=1024), PlanRing(path, 2, 2, capacity=1024)
    for _ in range(7):  # 7 x 136 bytes of 1,024: an eighth does not fit
        writer.send(b"x" * 128)
        assert fast.receive() == b"x" * 128
    with pytest.raises(TimeoutError, match="no room"):
        writer.send(b"y" * 128)
    assert slow.receive() == b"x" * 128  # room for one more
    writer.send(b"y" * 128)
    assert fast.receive() == b"y" * 128
    with pytest.raises(ValueError, match="the ring holds 1024"):
        writer.send(b"z" * 600)


def read_all(path: str, count: int, out: multiprocessing.Queue) -> None:
    reader = PlanRing(Path(path), 1, 1, capacity=1 << 16)
    digest = hashlib.sha256()
    for _ in range(count):
        digest.update(reader.receive())
    out.put(digest.hexdigest())


def test_a_reader_in_another_process_reads_what_was_written(tmp_path: Path) -> None:
    path = tmp_path / "ring"
    writer = PlanRing(path, 1, None, capacity=1 << 16)
    sent = messages(2, 3000, 5000)  # ~7.5 MB through 64 KiB: the writer waits on the reader
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    reader = context.Process(target=read_all, args=(str(path), len(sent), out))
    reader.start()
    for payload in sent:
        writer.send(payload)
    assert out.get(timeout=60) == hashlib.sha256(b"".join(sent)).hexdigest()
    reader.join(10)
    assert reader.exitcode == 0
