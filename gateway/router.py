"""One reader for every output stream this gateway process is waiting on.

``OutputRouter.run`` loops on ``queue_gateway.read_outputs``: one blocking XREAD over all subscribed
requests' streams, so a worker step that publishes deltas for 200 requests costs the gateway one
or two round trips, not 200, and one Redis connection, not one per request. A new subscription
wakes the XREAD (``queue_gateway.wake``) so its stream joins at once. Each record goes to its
subscriber's callback; after a request's final record it is dropped.

If Redis fails, the loop retries (every ``RETRY_S``) and the subscribers wait: when Redis comes
back within ``outage_s`` (restarted with its append-only file), reading goes on from each
stream's cursor, except for the requests Redis no longer knows (``queue_gateway.missing``: lost with
writes it had not persisted), whose subscribers get an error. Past ``outage_s``, every
subscriber gets the exception (their requests fail).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis
import redis.asyncio

from contracts import queue_gateway
from contracts.records import OutputRecord

log = logging.getLogger("pagedserve.gateway")

Sink = Callable[[OutputRecord | Exception], None]
RETRY_S = 0.5


@dataclass
class _Subscription:
    sink: Sink
    cursor: str = "0-0"
    entry_id: str = ""  # its request entry, once submitted
    stream: str = ""  # the request stream it was submitted to


class LostInRedis(Exception):
    """Redis came back without the request (a restart lost it)."""


class OutputRouter:
    def __init__(
        self,
        r: redis.asyncio.Redis,
        block_ms: int = 1000,
        outage_s: float = 30,
        on_reconnect: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``on_reconnect``: awaited when Redis answers again after an outage (the gateway
        renews its liveness key, which a restart may have lost)."""
        self.r = r
        self.block_ms = block_ms
        self.outage_s = outage_s
        self.on_reconnect = on_reconnect
        self.reader = f"gateway-{uuid.uuid4().hex[:12]}"
        self._subs: dict[str, _Subscription] = {}
        self._wake_cursor = "0-0"
        self._woken = False  # a wake is pending for the current XREAD
        self._stopping = False

    async def subscribe(self, req_id: str, sink: Sink) -> None:
        """``sink`` gets every record of ``req_id`` from the start of its stream, then stops
        being called after the final one (or an exception)."""
        self.add(req_id, sink)
        await self.wake()

    def add(self, req_id: str, sink: Sink) -> None:
        """``subscribe`` without the wake: its stream joins at the next XREAD (``wake`` to make
        that now)."""
        self._subs[req_id] = _Subscription(sink)

    async def wake(self) -> None:
        """Makes the running XREAD return so it takes in the streams added since it started
        (one wake per XREAD is enough)."""
        if not self._woken:
            self._woken = True
            await queue_gateway.wake(self.r, self.reader)

    def submitted(self, req_id: str, stream: str, entry_id: str) -> None:
        """``req_id`` was queued as ``entry_id`` of ``stream`` (checked for after a Redis
        outage)."""
        sub = self._subs.get(req_id)
        if sub is not None:
            sub.stream, sub.entry_id = stream, entry_id

    def unsubscribe(self, req_id: str) -> None:
        self._subs.pop(req_id, None)

    async def stop(self, task: asyncio.Task[None]) -> None:
        """Ends ``run`` (running as ``task``). Not by cancellation alone: redis-py 8 can swallow a
        cancellation that lands while it opens a connection, and the loop would go on; the flag
        ends it after the current XREAD (``block_ms`` at most)."""
        self._stopping = True
        task.cancel()
        await asyncio.wait([task], timeout=self.block_ms / 1000 + 5)

    async def run(self) -> None:
        """Reads until ``stop``ped or cancelled."""
        down_since: float | None = None
        while not self._stopping:
            self._woken = False
            cursors = {req_id: sub.cursor for req_id, sub in self._subs.items()}
            try:
                if down_since is not None:
                    await self._drop_lost()
                records, self._wake_cursor = await queue_gateway.read_outputs(
                    self.r, cursors, self.reader, self._wake_cursor, self.block_ms
                )
            except redis.RedisError as err:
                down_since = self._outage(err, down_since)
                await asyncio.sleep(RETRY_S)
                continue
            if down_since is not None:
                log.warning("redis is back after %.1f s", time.monotonic() - down_since)
                down_since = None
                if self.on_reconnect is not None:
                    await self.on_reconnect()
            for req_id, entry_id, record in records:
                sub = self._subs.get(req_id)
                if sub is None:
                    continue  # unsubscribed while the XREAD ran
                sub.cursor = entry_id
                if record.final:
                    del self._subs[req_id]
                sub.sink(record)

    def _outage(self, err: Exception, down_since: float | None) -> float:
        """Redis failed: subscribers wait until ``outage_s`` has passed, then all fail."""
        now = time.monotonic()
        if down_since is None:
            log.error(
                "reading output streams failed: %s; %d requests wait up to %.0f s for redis",
                err,
                len(self._subs),
                self.outage_s,
            )
            down_since = now
        if now - down_since >= self.outage_s and self._subs:
            log.error(
                "redis down for %.0f s: failing %d requests", now - down_since, len(self._subs)
            )
            subs, self._subs = self._subs, {}
            for sub in subs.values():
                sub.sink(err)
        return down_since

    async def _drop_lost(self) -> None:
        """After an outage: the subscriptions whose request Redis lost get an error."""
        submitted = {
            req_id: (sub.stream, sub.entry_id) for req_id, sub in self._subs.items() if sub.entry_id
        }
        for req_id in await queue_gateway.missing(self.r, submitted):
            sub = self._subs.pop(req_id, None)
            if sub is not None:
                log.warning("request %s was lost by a redis restart", req_id)
                sub.sink(LostInRedis(f"request {req_id} was lost when redis restarted"))
