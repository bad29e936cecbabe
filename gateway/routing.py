"""Which pool's request stream a request goes to, when the kvstore has several pools (GPUs) or
the gateway routes across several hosts (``--nodes``).

The kvstore places each request (``Route``: ``kvstore.placement``, from what every pool caches
and runs now). A burst of requests must not wait for one round trip each behind the workers'
step calls, so ``Routes`` batches: while one ``Route`` call is in flight, the requests that
arrive wait, and all of them go in the next call. When the kvstore does not answer, requests
go to the pools in turn (a warning each), so none is lost for want of a route.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from contracts import queue_keys
from contracts.records import RequestRecord
from gateway.kvclient import AsyncKVClient, KVStoreError, KVStoreTimeout
from kvstore import protocol as p

log = logging.getLogger("pagedserve.gateway")
MAX_BATCH = 512  # requests per Route call
AWAY_S = 5.0  # a host whose kvstore did not quote is left out of the batches this long


def routing_policy(name: str) -> p.RoutingPolicy:
    """``--routing``'s value as the protocol's policy."""
    policies: dict[str, p.RoutingPolicy] = {
        "prefix": "prefix",
        "least_loaded": "least_loaded",
        "round_robin": "round_robin",
    }
    return policies[name]


@dataclass(frozen=True)
class Placement:
    """Where a request goes: pool ``pool`` of host ``node`` (empty: the first host)."""

    node: str
    pool: int

    @property
    def stream(self) -> str:
        return queue_keys.request_stream(self.pool, self.node)

    def __str__(self) -> str:
        return f"{self.node}:{self.pool}" if self.node else str(self.pool)


class Routes:
    """The pool of each request, asked of the kvstore in batches. With other hosts (``nodes``:
    their names and kvstores, the gateway's ``--nodes``) each batch is quoted by every host's
    kvstore (``Route(book=False)``), each request goes to the host that prices it lowest (in
    turn for ``round_robin``), and that host's kvstore books it. A host that does not answer
    is left out of the batches for ``AWAY_S``."""

    def __init__(
        self,
        kv: AsyncKVClient,
        policy: p.RoutingPolicy,
        nodes: Sequence[tuple[str, AsyncKVClient]] = (),
        node: str = "",
    ) -> None:
        self.kv, self.policy, self.node = kv, policy, node  # node: this host's (``--node``)
        self.hosts: list[tuple[str, AsyncKVClient]] = [(node, kv), *nodes]
        self.pools = 1  # this host's, as its kvstore's stats said last (``AppState`` sets it)
        self._waiting: list[tuple[RequestRecord, asyncio.Future[Placement]]] = []
        self._sender: asyncio.Task[None] | None = None
        self._unrouted = 0  # requests the kvstore did not route (it was away), a counter
        self._turn = 0  # requests dealt to the hosts in turn (round_robin), a counter
        self._away: dict[str, float] = {}  # hosts whose kvstore did not quote: until when

    async def pool_for(self, record: RequestRecord) -> Placement:
        """Where ``record`` goes."""
        if self.pools == 1 and len(self.hosts) == 1:
            return Placement(self.node, 0)
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
            if len(self.hosts) == 1:
                placements = await self._book(self.node, self.kv, items)
            else:
                placements = await self._across_hosts(items)
            for (_, future), placement in zip(batch, placements, strict=True):
                if not future.done():  # its client may have gone
                    future.set_result(placement)

    async def _across_hosts(self, items: list[p.RouteItem]) -> list[Placement]:
        now = time.monotonic()
        asked = [i for i, (node, _) in enumerate(self.hosts) if self._away.get(node, 0.0) <= now]
        quote = p.Route(items, self.policy, book=False)
        answers = await asyncio.gather(*(self._ask(self.hosts[i][1], quote) for i in asked))
        quotes: dict[int, p.Routed | None] = dict(zip(asked, answers, strict=True))
        for i, answer in quotes.items():
            if answer is None:  # not asked again for a while: it would hold up every batch
                self._away[self.hosts[i][0]] = now + AWAY_S
        answered = [i for i, quote in quotes.items() if quote is not None]
        chosen: list[int] = []
        for k in range(len(items)):
            if not answered:
                chosen.append(0)
            elif self.policy == "round_robin":
                chosen.append(answered[self._turn % len(answered)])
                self._turn += 1
            else:
                chosen.append(min(answered, key=lambda i: cheapest(quotes[i], k)))
        shares = {host: [k for k, c in enumerate(chosen) if c == host] for host in set(chosen)}
        booked = await asyncio.gather(  # every host's share at once
            *(
                self._book(*self.hosts[host], [items[k] for k in mine])
                for host, mine in shares.items()
            )
        )
        placements: dict[int, Placement] = {}
        for mine, placed in zip(shares.values(), booked, strict=True):
            placements.update(zip(mine, placed, strict=True))
        return [placements[k] for k in range(len(items))]

    async def _book(
        self, node: str, kv: AsyncKVClient, items: list[p.RouteItem]
    ) -> list[Placement]:
        """``items`` booked on host ``node``; this host's pools in turn if it does not answer."""
        routed = await self._ask(kv, p.Route(items, self.policy))
        if routed is not None:
            return [Placement(node, item.pool) for item in routed.items]
        log.warning(
            "%d requests not routed by their kvstore: this host's pools in turn", len(items)
        )
        return [Placement(self.node, self._next_unrouted()) for _ in items]

    async def _ask(self, kv: AsyncKVClient, call: p.Route) -> p.Routed | None:
        """``call``'s answer, None (logged) if the kvstore did not give one for every item."""
        try:
            routed = await kv.call(call)
        except (KVStoreTimeout, KVStoreError) as err:
            log.warning("the kvstore at %s did not route (%s)", kv.endpoint, err)
            return None
        if len(routed.items) != len(call.items):
            log.warning(
                "the kvstore at %s routed %d of %d", kv.endpoint, len(routed.items), len(call.items)
            )
            return None
        return routed

    def _next_unrouted(self) -> int:
        self._unrouted += 1
        return self._unrouted % self.pools


def cheapest(quote: p.Routed | None, k: int) -> float:
    """The predicted seconds of item ``k`` on the quoting host's best pool (inf: none)."""
    if quote is None or not quote.items[k].predicted_s:
        return math.inf
    return min(quote.items[k].predicted_s)
