"""In-process cost of the kvstore's per-step call, without the socket: decode, handle, encode.

Drives ``KVService`` directly (a real ``KVCacheManager``; block moves are not needed for appends,
so the mover only reports zero seconds) with 256 requests decoding one token per step, both as a
columnar ``TokenBatch`` and as one ``AppendItem`` per request.

    python bench/step_profile.py [--requests 256] [--steps 500]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore import protocol as p
from kvstore.manager import KVCacheManager
from kvstore.service import KVService


class NoMoves:
    """Appends never move blocks between tiers; swaps would fail loudly here."""

    block_bytes = 8192

    def swap_out(self, pairs: list[tuple[int, int]]) -> float:
        raise AssertionError("no swap expected")

    def swap_in(self, pairs: list[tuple[int, int]]) -> float:
        raise AssertionError("no swap expected")

    def export(self) -> p.PoolInfo:
        return p.PoolInfo("shm", [1], "float32", 16, shm_path="/dev/null")


def profile(requests: int, steps: int, columnar: bool) -> tuple[float, float, float]:
    service = KVService(
        KVCacheManager(requests * (512 + steps) // 16 + requests, 0), NoMoves(), 60, 60
    )
    service.handle(p.Register("w"))
    ids = [f"req-{i}" for i in range(requests)]
    admits = [p.AdmitItem(r, [i * 100_000 + t for t in range(512)]) for i, r in enumerate(ids)]
    service.handle(p.Step("w", admits=admits))
    service.handle(p.Step("w", appends=[p.AppendItem(r, [0], 512) for r in ids]))
    length = 513
    times: list[tuple[float, float, float]] = []
    for step in range(steps):
        if columnar:
            body = p.Step("w", tokens=p.TokenBatch(ids, [step] * requests, [length] * requests))
        else:
            body = p.Step("w", appends=[p.AppendItem(r, [step], length) for r in ids])
        data = p.encode(p.Call(p.PROTOCOL_VERSION, step, body))
        t0 = time.perf_counter()
        call = p.decode_call(data)
        t1 = time.perf_counter()
        reply = service.handle(call.body)
        t2 = time.perf_counter()
        p.encode(p.Reply(p.PROTOCOL_VERSION, step, reply))
        t3 = time.perf_counter()
        assert isinstance(reply, p.StepReply) and not reply.errors
        length += 1
        times.append((t1 - t0, t2 - t1, t3 - t2))
    service.manager.check_integrity()
    return tuple(statistics.median(col) * 1e6 for col in zip(*times[steps // 5 :], strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    print("| step body | decode µs | handle µs | encode reply µs |")
    print("|---|---|---|---|")
    for columnar in (True, False):
        name = f"TokenBatch of {args.requests}" if columnar else f"{args.requests} AppendItems"
        decode, handle, encode = profile(args.requests, args.steps, columnar)
        print(f"| {name} | {decode:.0f} | {handle:.0f} | {encode:.0f} |")


if __name__ == "__main__":
    main()
