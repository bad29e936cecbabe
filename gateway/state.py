"""What every handler of one gateway app shares: config, model, clients, metrics, and the
requests in flight (for a shutdown that drains them).

Background work, on the app's loop: the output router (``gateway.router``), the liveness loop,
which renews this gateway's liveness key in Redis every third of its TTL (workers abort the
requests of a gateway whose key expired), on a clock of its own, and the housekeeping loop,
which refreshes what the kvstore can hold (``kv_capacity``, the admission check of
``gateway.prepare``) and how many pools it has (``routes.pools``). With several, each request
goes to the request stream of the pool the kvstore routes it to (``gateway.routing``), and the
requests of a pool left without a worker move to the others (``gateway.stranded``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import redis.asyncio
from aiohttp import web
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from contracts import queue_gateway, queue_keys
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.generation import Generation
from gateway.kvclient import AsyncKVClient, KVStoreError, KVStoreTimeout
from gateway.limits import KVCapacity
from gateway.metrics import Metrics
from gateway.model_info import ModelInfo
from gateway.router import OutputRouter
from gateway.routing import Routes, routing_policy
from gateway.stranded import Stranded

log = logging.getLogger("pagedserve.gateway")
QUEUE_LENGTH_TTL_S = 0.05  # back-pressure reads XLEN at most this often
REDIS_MAX_CONNECTIONS = 256  # more concurrent commands wait for a free connection
REDIS_RETRIES = 3  # a command that fails on its connection (Redis restarted) is tried again
CAPACITY_REFRESH_S = 5.0  # how often the kvstore's capacity is read again
PREPARE_THREADS = 4  # request parsing and tokenizing, off the event loop
T = TypeVar("T")


@dataclass
class AppState:
    config: GatewayConfig
    model: ModelInfo
    admin_token: str | None
    metrics: Metrics
    api_key: str | None = None
    gateway_id: str = field(default_factory=lambda: f"gateway-{uuid.uuid4().hex[:12]}")
    draining: bool = False  # shutting down: new requests get 503
    kv_capacity: KVCapacity | None = None  # None until the kvstore answered once
    _redis: redis.asyncio.Redis | None = None
    _kv: AsyncKVClient | None = None
    _router: OutputRouter | None = None
    _routes: Routes | None = None
    _stranded: Stranded | None = None
    _executor: ThreadPoolExecutor | None = None
    _in_flight: set[Generation] = field(default_factory=set)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    _queue_length: int = 0
    _queue_length_at: float = field(default=float("-inf"))

    @property
    def redis(self) -> redis.asyncio.Redis:
        assert self._redis is not None, "the app is not running"
        return self._redis

    @property
    def kv(self) -> AsyncKVClient:
        assert self._kv is not None, "the app is not running"
        return self._kv

    @property
    def routes(self) -> Routes:
        assert self._routes is not None, "the app is not running"
        return self._routes

    @property
    def router(self) -> OutputRouter:
        assert self._router is not None, "the app is not running"
        return self._router

    async def connections(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup context: clients, the output reader and the housekeeping loop live
        on the app's loop. On the way out the liveness key is dropped, so workers abort what
        is left of this gateway's requests at once."""
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            self.config.redis_url,
            max_connections=REDIS_MAX_CONNECTIONS,
            timeout=None,
            # a connection Redis closed (it restarted) fails once and is retried on a new one
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), REDIS_RETRIES),
            # no CLIENT SETINFO: redis-py looks its version up in the package metadata for each
            # new connection (2 ms of the loop each; a burst of 128 requests opens ~130)
            lib_name=None,
            lib_version=None,
        )
        self._redis = redis.asyncio.Redis(connection_pool=pool)
        self._kv = AsyncKVClient(self.config.kvstore, self.config.kvstore_timeout_s)
        timeout_s = self.config.kvstore_timeout_s
        nodes = [(n, AsyncKVClient(e, timeout_s)) for n, e in self.config.node_endpoints()]
        policy, node = routing_policy(self.config.routing), self.config.node
        self._routes = Routes(self._kv, policy, nodes, node)
        mover = f"gateway-{self.gateway_id}"
        self._stranded = Stranded(self._redis, self._routes, mover, self.config.move_after_s)
        self._router = OutputRouter(
            self._redis, outage_s=self.config.redis_outage_s, on_reconnect=self._renew
        )
        self._executor = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")
        self._idle.set()
        await self._renew()  # before any request can name this gateway
        await self._read_capacity()
        reader = asyncio.create_task(self._router.run(), name="output-router")
        liveness = asyncio.create_task(self._liveness(), name="liveness")
        housekeeping = asyncio.create_task(self._housekeeping(), name="housekeeping")
        yield
        liveness.cancel()
        housekeeping.cancel()
        await self._router.stop(reader)
        with contextlib.suppress(redis.RedisError):
            await queue_gateway.drop_gateway(self._redis, self.gateway_id)
        await self._redis.aclose()
        await pool.aclose()
        self._kv.close()
        for _, kv in nodes:
            kv.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ background
    async def _liveness(self) -> None:
        """Renews the liveness key every third of its TTL, at a fixed rate: a live gateway's
        key survives two missed renewals, and no other work (a kvstore call that waits for
        its timeout) delays them."""
        loop = asyncio.get_running_loop()
        interval = self.config.liveness_ttl_s / 3
        due = loop.time()
        while True:
            due = max(due + interval, loop.time())
            await asyncio.sleep(due - loop.time())
            await self._renew()

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(CAPACITY_REFRESH_S)
            await self._read_capacity()

    async def _renew(self) -> None:
        """Renews the liveness key; when Redis is away it is tried again next time (and when
        the output router sees Redis back)."""
        try:
            await queue_gateway.renew_gateway(
                self.redis, self.gateway_id, self.config.liveness_ttl_s
            )
        except redis.RedisError as err:
            log.warning("cannot renew the gateway's liveness in Redis: %s", err)

    async def _read_capacity(self) -> None:
        """Reads what the kvstore can hold for one request; when the kvstore is away it is
        tried again next time."""
        try:
            stats = await self.kv.stats(0)
            self.kv_capacity = KVCapacity(stats.admission_limit_blocks, stats.block_size)
            self.routes.pools = max(len(stats.pools), 1)
        except (KVStoreTimeout, KVStoreError):
            return  # /health says the kvstore is down
        if self._stranded is not None:
            try:
                await self._stranded.check(stats.pools)
            except redis.RedisError as err:
                log.warning("cannot move the requests of a pool without a worker: %s", err)

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in the app's thread pool (parsing, tokenizing): the event loop keeps
        serving every other stream meanwhile."""
        assert self._executor is not None, "the app is not running"
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    # ------------------------------------------------------------------ requests in flight
    @contextlib.contextmanager
    def in_flight(self, gen: Generation) -> Iterator[None]:
        """Counts ``gen`` in flight while its handler runs (``drain`` waits for them)."""
        self._in_flight.add(gen)
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight.discard(gen)
            if not self._in_flight:
                self._idle.set()

    async def drain(self, timeout_s: float) -> int:
        """Stops taking requests and waits up to ``timeout_s`` for those in flight to finish;
        then cuts the rest (error event and [DONE], or 503) and waits for their handlers to
        answer. Returns how many were cut."""
        self.draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        cut = list(self._in_flight)
        error = APIError(503, "the server is shutting down", code="server_shutdown")
        for gen in cut:
            gen.cancel(error)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), 5.0)
        return len(cut)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def queue_length(self, fresh: bool = False) -> int:
        """Entries in the Redis request stream (waiting or in flight), re-read at most every
        ``QUEUE_LENGTH_TTL_S`` unless ``fresh``."""
        now = time.monotonic()
        if fresh or now - self._queue_length_at > QUEUE_LENGTH_TTL_S:
            async with self.redis.pipeline(transaction=False) as pipe:
                for pool in range(self.routes.pools):
                    pipe.xlen(queue_keys.request_stream(pool, self.config.node))
                lengths = await pipe.execute()
            self._queue_length = sum(int(n) for n in lengths)
            self._queue_length_at = now
        return self._queue_length


STATE = web.AppKey("state", AppState)
