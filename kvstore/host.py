"""The daemon's handlers over the host's pools: one ``KVService`` per pool (GPU), and what spans
them. Torch-free; called only from the daemon's single-threaded loop.

- A worker registers with a pool (``Register.pool``); its calls go to that pool's service.
- ``Route`` places a request on a pool (``kvstore.placement``) from what every pool holds and
  runs now, and counts it as queued there until a worker of that pool admits it.
- Before a pool's worker admits a request, the longest chain of its prompt's blocks that another
  pool holds (its GPU tier, carried on by its CPU tier) and this pool does not is copied over, or
  left to be recomputed, whichever the cost model prices lower (``--peer-copy``): the blocks on
  the other GPU are copied GPU to GPU, those only its CPU tier holds are loaded from that tier
  straight into this pool. The copy runs here, synchronised, before the admission, which then
  hits the copied blocks like any cached prefix.
- ``GetStats`` sums the pools and lists each (``PoolRow``).

One prefix index per pool, exact: a request's entry in every pool is looked up, which is what an
entry naming every pool that holds it would give. Each pool keeps its own CPU tier (a share of
``--swap-memory``); any pool loads from any of them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import msgspec

from kvstore import protocol as p
from kvstore.cost_model import LinearCost
from kvstore.manager import KVCacheManager
from kvstore.placement import PoolView, Prices, choose_pool
from kvstore.prefix_index import LookupResult
from kvstore.request_blocks import extend_hashes
from kvstore.requests import KVError, Request, table_blocks
from kvstore.service import KVService
from kvstore.stats import add_up, merge_stats, pool_row

log = logging.getLogger("pagedserve.kvstore")
PeerCopyMode = Literal["auto", "always", "never"]
# (src pool, dst pool, (src block, dst GPU block) pairs, the src blocks' tier) -> seconds
Copier = Callable[[int, int, list[tuple[int, int]], p.Tier], float]
ROUTED_TTL_S = 300.0  # a routed request no worker admitted in this long stops counting as queued
PRIOR_PREFILL_S_PER_TOKEN = 1e-4  # before any worker of the host sent a prefill profile
PRIOR_COPY = LinearCost(50e-6, 20e-6)  # before the daemon timed copies between its pools
PRIOR_LOAD = LinearCost(50e-6, 150e-6)  # before a pool calibrated its CPU tier's loads


@dataclass(frozen=True)
class _Routed:
    pool: int
    tokens: int  # the prefill it owes its pool
    at: float


class Host:
    def __init__(
        self,
        services: list[KVService],
        devices: list[str],
        copier: Copier | None = None,
        copy_price: LinearCost | None = None,
        peer_copy: PeerCopyMode = "auto",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not services or len(services) != len(devices):
            raise ValueError("a host needs one service and one device name per pool")
        self.services, self.devices, self.clock = services, devices, clock
        self.copier, self.copy_price, self.peer_copy = copier, copy_price, peer_copy
        self.started = clock()
        self._pool_of: dict[str, int] = {}  # worker id -> its pool
        self._routed: dict[str, _Routed] = {}
        self._queued_tokens = [0] * len(services)
        self._loaded_in = [0] * len(services)  # blocks loaded from other pools' CPU tiers
        self._turn = 0  # requests routed round robin, a counter
        self.busy_s: dict[str, float] = {}  # Stats.busy_s: by message, between_calls, peer_copies

    @property
    def managers(self) -> list[KVCacheManager]:
        return [s.manager for s in self.services]

    # ------------------------------------------------------------------ dispatch
    def handle(self, body: p.Request) -> p.ReplyBody:
        """``body``'s reply; its handling time counts in ``busy_s`` under its type's name."""
        start = time.perf_counter()
        try:
            return self._dispatch(body)
        finally:
            self._busy(type(body).__name__, time.perf_counter() - start)

    def _busy(self, kind: str, seconds: float) -> None:
        self.busy_s[kind] = self.busy_s.get(kind, 0.0) + seconds

    def _dispatch(self, body: p.Request) -> p.ReplyBody:
        match body:
            case p.Register():
                return self._register(body)
            case p.Step() | p.Heartbeat() | p.Unregister():
                pool = self._pool_of.get(body.worker_id)
                if pool is None:
                    return p.Error("unknown_worker", f"worker {body.worker_id!r} must register")
                if isinstance(body, p.Unregister):
                    del self._pool_of[body.worker_id]
                if not isinstance(body, p.Step):
                    return self.services[pool].handle(body)
                return self._step(pool, body)
            case p.GetStats():
                return self._stats(body)
            case p.ResetCache():
                replies = [s.handle(body) for s in self.services]
                return p.CacheReset(sum(r.blocks for r in replies if isinstance(r, p.CacheReset)))
            case p.Ping():
                return p.Pong(self.clock() - self.started, len(self.services))
            case p.GetBlockMap() | p.GetBlockInfo():
                if not 0 <= body.pool < len(self.services):
                    return p.Error("bad_message", self._no_pool(body.pool))
                return self.services[body.pool].handle(body)
            case p.Route():
                return self.route(body)
        return p.Error("bad_message", f"unhandled message {type(body).__name__}")

    def between_calls(self) -> int:
        start = time.perf_counter()
        copied = sum(s.between_calls() for s in self.services)
        if copied:
            self._busy("between_calls", time.perf_counter() - start)
        return copied

    def tick(self) -> None:
        for service in self.services:
            service.tick()
        now = self.clock()
        for req_id in [r for r, routed in self._routed.items() if now - routed.at > ROUTED_TTL_S]:
            self._admitted(req_id)

    def _no_pool(self, pool: int) -> str:
        n = len(self.services)
        return f"pool {pool} is not one of this host's {n} (0 to {n - 1})"

    def _register(self, body: p.Register) -> p.ReplyBody:
        if not 0 <= body.pool < len(self.services):
            return p.Error("bad_message", self._no_pool(body.pool))
        old = self._pool_of.get(body.worker_id)
        if old is not None and old != body.pool:  # it moved: its old pool's requests orphaned
            self.services[old].handle(p.Unregister(body.worker_id))
        self._pool_of[body.worker_id] = body.pool
        return self.services[body.pool].handle(body)

    # ------------------------------------------------------------------ routing
    def route(self, body: p.Route) -> p.Routed:
        """Places ``body``'s items in turn, each counted queued before the next; a quote
        (``book=False``) places them the same way, then forgets them."""
        if body.book:
            return p.Routed([self._route_one(item, body.policy) for item in body.items])
        booked = dict(self._routed), list(self._queued_tokens), self._turn
        try:
            return p.Routed([self._route_one(item, body.policy) for item in body.items])
        finally:
            self._routed, self._queued_tokens, self._turn = booked

    def _route_one(self, item: p.RouteItem, policy: p.RoutingPolicy) -> p.RoutedItem:
        self._admitted(item.req_id)  # routed again (a retry): counted once, not where it was
        keys, contents = self._chain(item.token_ids, item.salt)
        managers = self.managers
        hits = [m.index.lookup(keys, contents, len(item.token_ids), record=False) for m in managers]
        views = [
            PoolView(
                i,
                hit.gpu_run,
                m.pool.num_available - m.watermark_blocks - idle_hits(m, hit),
                len(m.requests),
                self._queued_tokens[i],
                bool(self.services[i].leases.workers),
                max(m.pool.num_free - m.watermark_blocks, 0),
                len(hit.gpu),
            )
            for i, (m, hit) in enumerate(zip(managers, hits, strict=True))
        ]
        block_size = managers[0].block_size
        placed = choose_pool(
            views, len(item.token_ids), block_size, self._prices(), policy, self._turn
        )
        self._turn += policy == "round_robin"
        owed = len(item.token_ids) - placed.cached_tokens
        self._routed[item.req_id] = _Routed(placed.pool, owed, self.clock())
        self._queued_tokens[placed.pool] += owed
        return p.RoutedItem(
            placed.pool, placed.cached_tokens, placed.bring, placed.reason, list(placed.predicted_s)
        )

    def _admitted(self, req_id: str) -> None:
        routed = self._routed.pop(req_id, None)
        if routed is not None:
            self._queued_tokens[routed.pool] -= routed.tokens

    def _prices(self) -> Prices:
        per_token = PRIOR_PREFILL_S_PER_TOKEN
        for manager in self.managers:
            profiles = manager.pricing.prefill_profiles.values()
            points = [point for profile in profiles for point in profile if point[0] > 0]
            if points:
                tokens, seconds = max(points)
                per_token = seconds / tokens
                break
        copy, load = self.copy_price or PRIOR_COPY, self._load_price()
        return Prices(per_token, copy.fixed_s, copy.per_unit_s, load.fixed_s, load.per_unit_s)

    def _load_price(self) -> LinearCost:
        """A batch of CPU-tier blocks loaded into a GPU: the first pool's calibrated swap-in
        (the pools' host links are alike)."""
        for manager in self.managers:
            if manager.pricing.calibration is not None:
                return manager.pricing.calibration.swap_in
        return PRIOR_LOAD

    def _chain(self, token_ids: list[int], salt: bytes | None) -> tuple[list[bytes], list[bytes]]:
        request = Request("", "", salt, list(token_ids))
        extend_hashes(request, self.managers[0].block_size)
        return request.keys, request.contents

    # ------------------------------------------------------------------ steps and copies
    def _step(self, pool: int, body: p.Step) -> p.ReplyBody:
        bring = None
        if len(self.services) > 1:
            bring = functools.partial(self._bring, pool, body.worker_id)
        reply = self.services[pool].handle(body, bring)
        if isinstance(reply, p.StepReply):
            for placed in reply.admitted:
                self._admitted(placed.req_id)
        return reply

    def _bring(self, pool: int, worker: str, item: p.AdmitItem) -> list[int]:
        """Copies into ``pool`` the blocks of ``item``'s prompt that another pool holds beyond
        what ``pool`` holds (on its GPU, or only in its CPU tier: loaded from there), if the
        cost model (or ``--peer-copy``) says so: called by the pool's service right before the
        admission (the step's frees and appends ran). The blocks it holds once each, which the
        service releases after the admission: those received and the pool's own blocks of the
        chain, kept from eviction meanwhile."""
        if self.peer_copy == "never" or self.copier is None:
            return []
        keys, contents = self._chain(item.token_ids, item.salt)
        num_tokens = len(item.token_ids)
        hits = [m.index.lookup(keys, contents, num_tokens, record=False) for m in self.managers]
        here = hits[pool]
        source = max(
            range(len(hits)), key=lambda i: (len(hits[i].gpu), hits[i].gpu_run, i == pool, -i)
        )
        if len(hits[source].gpu) <= len(here.gpu):  # its tiers hold as much
            return []
        dst, end = self.managers[pool], len(hits[source].gpu)
        entries = [dst.index.entry(key) for key in keys[:end]]
        own = [e.block for e in entries if e is not None and e.block is not None]
        positions = [i for i, e in enumerate(entries) if e is None or e.block is None]
        idle_own = sum(dst.pool.ref_counts[b] == 0 for b in own)
        room = dst.pool.num_available - idle_own - dst.watermark_blocks
        if room < table_blocks(num_tokens, dst.block_size) - len(own):
            return []
        from_cpu = [i for i in positions if hits[source].gpu[i] is None]
        bs = dst.block_size
        copy_s = (self.copy_price or PRIOR_COPY).seconds(len(positions) - len(from_cpu))
        choice = dst.pricing.peer_copy(
            worker,
            copy_s + (self._load_price().seconds(len(from_cpu)) if from_cpu else 0.0),
            (end - here.gpu_run) * bs,
            here.gpu_run * bs,
            max(num_tokens - end * bs, 0),
            sum(r.worker == worker for r in dst.requests.values()),
        )
        if self.peer_copy == "always" and choice.mode != "copy":
            choice = replace(choice, mode="copy", reason="--peer-copy always")
        decision = dst.decisions.record(
            item.req_id, self.clock(), len(positions), len(positions) * bs, choice, "peer"
        )
        if choice.mode != "copy":
            return []
        for block in own:  # not evicted by the blocks received
            dst.pool.ref(block)
        try:
            blocks = dst.store.receive(keys, contents, positions)
        except KVError:  # no room after all (the check above should have said so)
            dst.pool.release(own)
            raise
        self.services[pool].run_pending()  # what receiving evicted is demoted before the copy
        pairs: dict[p.Tier, list[tuple[int, int]]] = {"gpu": [], "cpu": []}
        for i, block in zip(positions, blocks, strict=True):
            on_gpu, on_cpu = hits[source].gpu[i], hits[source].cpu[i]
            if on_gpu is not None:
                pairs["gpu"].append((on_gpu, block))
            else:
                assert on_cpu is not None, "a lookup position held by neither tier"
                pairs["cpu"].append((on_cpu, block))
        seconds = sum(self.copier(source, pool, some, tier) for tier, some in pairs.items() if some)
        self._busy("peer_copies", seconds)
        self._loaded_in[pool] += len(pairs["cpu"])
        dst.decisions.add_actual(decision.id, seconds)
        log.info(
            "copied %d blocks of %s from pool %d (%d from its CPU tier) to pool %d in %.2f ms (%s)",
            len(blocks),
            item.req_id,
            source,
            len(from_cpu),
            pool,
            seconds * 1e3,
            choice.reason,
        )
        return own + blocks

    # ------------------------------------------------------------------ stats
    def _stats(self, body: p.GetStats) -> p.ReplyBody:
        replies = [s.handle(body) for s in self.services]
        stats = [r for r in replies if isinstance(r, p.Stats)]
        rows = [
            pool_row(
                i,
                self.devices[i],
                s.manager,
                [w for w in self.services[i].leases.workers if self._pool_of.get(w) == i],
                sum(r.pool == i for r in self._routed.values()),
                self._queued_tokens[i],
                self._loaded_in[i],
            )
            for i, s in enumerate(self.services)
        ]
        merged = merge_stats(stats, rows, body.top_prefixes)
        return msgspec.structs.replace(merged, busy_s=add_up([merged.busy_s, self.busy_s]))


def idle_hits(m: KVCacheManager, hit: LookupResult) -> int:
    """The blocks of ``hit``'s GPU run that no request holds: counted free by the pool, but
    an admission of the request takes them, it does not allocate them."""
    return sum(m.pool.ref_counts[b] == 0 for b in hit.gpu[: hit.gpu_run] if b is not None)
