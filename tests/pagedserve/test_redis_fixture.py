"""The Redis every later test relies on is a real server: streams, consumer groups, XAUTOCLAIM."""

from __future__ import annotations

import time

import redis


def test_streams_consumer_groups_and_autoclaim(redis_client: redis.Redis) -> None:
    r = redis_client
    r.xgroup_create("req:stream", "workers", id="0", mkstream=True)
    ids = [r.xadd("req:stream", {"n": str(i)}) for i in range(3)]
    got = r.xreadgroup("workers", "w1", {"req:stream": ">"}, count=3)
    assert isinstance(got, list)  # RESP2: [[stream, entries]]
    assert [entry_id for entry_id, _ in got[0][1]] == ids
    r.xack("req:stream", "workers", ids[0])
    time.sleep(0.05)
    claimed = r.xautoclaim("req:stream", "workers", "w2", min_idle_time=10)[1]  # 6.2: 2 fields
    assert [entry_id for entry_id, _ in claimed] == ids[1:]  # the unacked ones move to w2
    assert r.xpending("req:stream", "workers")["pending"] == 2
