"""Which pool's request stream a request goes to, when the kvstore has several pools (GPUs).

The kvstore places each request (``Route``: ``kvstore.placement``, from what every pool caches
and runs now). A burst of requests must not wait for one round trip each behind the workers'
step calls, so ``Routes`` batches: while one ``Route`` call is in flight, the requests that
arrive wait, and all of them go in the next call. When the kvstore does not answer, requests
go to the pools in turn (a warning each), so none is lost for want of a route.
"""

from __future__ import annotations

import asyncio
import logging

from contracts.records import RequestRecord
from gateway.kvclient import AsyncKVClient, KVStoreError, KVStoreTimeout
from kvstore import protocol as p

log = logging.getLogger("pagedserve.gateway")
MAX_BATCH = 512  # requests per Route call


def routing_policy(name: str) -> p.RoutingPolicy:
    """``--routing``'s value as the protocol's policy."""
    policies: dict[str, p.RoutingPolicy] = {
        "prefix": "prefix",
        "least_loaded": "least_loaded",
        "round_robin": "round_robin",
    }
    return policies[name]


class Routes:
    def __init__(self, kv: AsyncKVClient, policy: p.RoutingPolicy) -> None:
        self.kv, self.policy = kv, policy
        self.pools = 1  # the kvstore's, as its stats said last (``AppState`` sets it)
        self._waiting: list[tuple[RequestRecord, asyncio.Future[int]]] = []
        self._sender: asyncio.Task[None] | None = None
        self._unrouted = 0  # requests the kvstore did not route (it was away), a counter

    async def pool_for(self, record: RequestRecord) -> int:
        """The pool ``record`` goes to (its stream: ``queue_keys.request_stream``)."""
        if self.pools == 1:
            return 0
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((record, future))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send(), name="route")
        return await future

    async def _send(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
            items = [
                p.RouteItem(record.req_id, record.prompt_token_ids, record.salt)
                for record, _ in batch
            ]
            try:
                routed = await self.kv.call(p.Route(items, self.policy))
                pools = [item.pool for item in routed.items]
                if len(pools) != len(batch):
                    raise ValueError(f"{len(pools)} routes for {len(batch)} requests")
            except (KVStoreTimeout, KVStoreError, ValueError) as err:
                pools = [self._next_unrouted() for _ in batch]
                log.warning(
                    "the kvstore did not route %d requests (%s): pools in turn", len(batch), err
                )
            for (_, future), pool in zip(batch, pools, strict=True):
                if not future.done():  # its client may have gone
                    future.set_result(pool)

    def _next_unrouted(self) -> int:
        self._unrouted += 1
        return self._unrouted % self.pools
