"""Redis's own time per call (``INFO commandstats``) for the two commands that carry every token:
a worker's publish ``EVAL`` of one step's records (``contracts.queue_worker.publish``) and a
gateway's ``XREAD`` over the output streams of its requests (``contracts.queue_gateway``), each
over K streams, on a local redis-server with nothing else to do.

A gateway re-arms its XREAD after every wake, and a wake comes with any worker's step that
touches one of its requests: Redis then checks every stream of that gateway again. So the XREAD
side grows with (worker steps per second, all workers) x (requests in flight), whatever the
number of gateways, while the publish side grows with tokens per second.

    python bench/redis_cost.py [--streams 16,64,256] [--calls 300]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import redis
from redis.typing import KeyT, StreamIdT

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from contracts import queue_keys, queue_worker  # noqa: E402
from contracts.records import OutputRecord  # noqa: E402
from pagedserve.redis_server import find_redis_server, free_port  # noqa: E402


def usec_per_call(r: redis.Redis, command: str, calls: int, run: Callable[[], object]) -> float:
    """Redis's own microseconds per ``command`` call over ``calls`` runs of ``run``."""
    before = r.info("commandstats").get(f"cmdstat_{command}", {"calls": 0, "usec": 0})
    for _ in range(calls):
        run()
    after = r.info("commandstats")[f"cmdstat_{command}"]
    return float(after["usec"] - before["usec"]) / max(after["calls"] - before["calls"], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="16,64,256", help="K, comma-separated")
    parser.add_argument("--calls", type=int, default=300, help="calls timed per command and K")
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        server = subprocess.Popen(
            [find_redis_server(), "--port", str(port), "--save", "", "--appendonly", "no",
             "--dir", directory],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            r = redis.Redis(port=port)
            deadline = time.monotonic() + 10
            while True:
                try:
                    r.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            print("| streams K | publish EVAL of K records, us | per record | XREAD of K streams "
                  "(nothing new), us | per stream |")  # fmt: skip
            print("|---|---|---|---|---|")
            for k in (int(s) for s in args.streams.split(",")):
                records = [OutputRecord(f"k{k}-{i}", token_ids=[1], text="a") for i in range(k)]
                queue_worker.publish(r, records)
                keys = [queue_keys.output_key(rec.req_id) for rec in records]
                publish = usec_per_call(
                    r, "eval", args.calls, partial(queue_worker.publish, r, records)
                )
                last: dict[KeyT, StreamIdT] = {
                    key: r.xinfo_stream(key)["last-generated-id"] for key in keys
                }
                xread = usec_per_call(r, "xread", args.calls, partial(r.xread, last, count=64))
                print(f"| {k} | {publish:.1f} | {publish / k:.2f} | {xread:.1f} | "
                      f"{xread / k:.2f} |")  # fmt: skip
        finally:
            server.terminate()
            server.wait(10)


if __name__ == "__main__":
    main()
