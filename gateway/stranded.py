"""Requests stranded on a pool that has no worker, moved to the pools that have one.

A worker that dies leaves its requests pending in its pool's stream: another worker of the pool
takes them over, a restarted one takes them back (``compute.loop.intake``). A pool left without
any worker for ``--move-after-s`` (its GPU failed, its worker cannot start) would hold them for
good, so the gateway moves them. Each time it reads the pools' rows (``GetStats``, every few
seconds) it takes, from the stream of every pool without a worker that long, the entries no live
worker holds (``queue_gateway.take_stranded``: pending and untouched that long, or never read),
places each as a new request (``Routes``: the kvstore prices the pools that have workers, a copy
of its cached prefix over NVLink included) and queues it there marked to resume
(``queue_gateway.move``): the worker that reads it goes on from what it already streamed and
recomputes the rest. Several gateways may do this at once: each entry is claimed by one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis.asyncio

from contracts import queue_gateway, queue_keys
from gateway.routing import Routes
from kvstore import protocol as p

log = logging.getLogger("pagedserve.gateway")
MAX_MOVES = 64  # requests moved per pool and check, at most


class Stranded:
    """Owns when each pool of this host was last seen without a worker; moves what its stream
    holds once that has lasted ``after_s`` (0: never)."""

    def __init__(self, r: redis.asyncio.Redis, routes: Routes, mover: str, after_s: float):
        self.redis, self.routes, self.mover, self.after_s = r, routes, mover, after_s
        self._empty_since: dict[int, float] = {}  # pool -> since when it has had no worker

    async def check(self, pools: Sequence[p.PoolRow]) -> int:
        """Moves the requests stranded on the pools without a worker for ``after_s``, while
        another pool has one; returns how many moved."""
        now = time.monotonic()
        for row in pools:
            if row.workers:
                self._empty_since.pop(row.pool, None)
            else:
                self._empty_since.setdefault(row.pool, now)
        if self.after_s <= 0 or len(pools) < 2 or all(not row.workers for row in pools):
            return 0
        moved = 0
        for pool, since in sorted(self._empty_since.items()):
            if now - since >= self.after_s:
                moved += await self._move_from(pool, now - since)
        return moved

    async def _move_from(self, pool: int, empty_s: float) -> int:
        src = queue_keys.request_stream(pool, self.routes.node)
        idle_ms = int(self.after_s * 1000)
        stranded = await queue_gateway.take_stranded(
            self.redis, src, self.mover, idle_ms, MAX_MOVES
        )
        moved = 0
        for entry_id, record in stranded:
            placement = await self.routes.pool_for(record)
            if placement.stream == src:  # placed here again: it waits for a worker of its own
                continue
            await queue_gateway.move(self.redis, entry_id, record, src, placement.stream)
            moved += 1
            log.warning(
                "request %s moved from pool %d (no worker for %.0f s) to pool %s: it resumes "
                "there from what it streamed",
                record.req_id,
                pool,
                empty_s,
                placement,
            )
        return moved
