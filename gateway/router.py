"""One reader for every output stream this gateway process is waiting on.

``OutputRouter.run`` loops on ``queue.read_outputs``: one blocking XREAD over all subscribed
requests' streams, so a worker step that publishes deltas for 200 requests costs the gateway one
or two round trips, not 200, and one Redis connection, not one per request. A new subscription
wakes the XREAD (``queue.wake``) so its stream joins at once. Each record goes to its
subscriber's callback; after a request's final record it is dropped. If Redis fails, every
subscriber gets the exception (their requests fail) and the loop retries.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis
import redis.asyncio

from gateway import queue

log = logging.getLogger("pagedserve.gateway")

Sink = Callable[[queue.OutputRecord | Exception], None]
RETRY_S = 0.5


@dataclass
class _Subscription:
    sink: Sink
    cursor: str = "0-0"


class OutputRouter:
    def __init__(self, r: redis.asyncio.Redis, block_ms: int = 1000) -> None:
        self.r = r
        self.block_ms = block_ms
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
            await queue.wake(self.r, self.reader)

    def unsubscribe(self, req_id: str) -> None:
        self._subs.pop(req_id, None)

    @property
    def num_subscribed(self) -> int:
        return len(self._subs)

    async def stop(self, task: asyncio.Task[None]) -> None:
        """Ends ``run`` (running as ``task``). Not by cancellation alone: redis-py 8 can swallow a
        cancellation that lands while it opens a connection, and the loop would go on; the flag
        ends it after the current XREAD (``block_ms`` at most)."""
        self._stopping = True
        task.cancel()
        await asyncio.wait([task], timeout=self.block_ms / 1000 + 5)

    async def run(self) -> None:
        """Reads until ``stop``ped or cancelled."""
        while not self._stopping:
            self._woken = False
            cursors = {req_id: sub.cursor for req_id, sub in self._subs.items()}
            try:
                records, self._wake_cursor = await queue.read_outputs(
                    self.r, cursors, self.reader, self._wake_cursor, self.block_ms
                )
            except redis.RedisError as err:
                log.error("reading output streams failed: %s; retrying", err)
                subs, self._subs = self._subs, {}
                for sub in subs.values():
                    sub.sink(err)
                await asyncio.sleep(RETRY_S)
                continue
            for req_id, entry_id, record in records:
                sub = self._subs.get(req_id)
                if sub is None:
                    continue  # unsubscribed while the XREAD ran
                sub.cursor = entry_id
                if record.final:
                    del self._subs[req_id]
                sub.sink(record)
