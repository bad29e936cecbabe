"""What every handler of one gateway app shares: config, model, clients, metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import redis.asyncio
from aiohttp import web

from gateway import queue
from gateway.config import GatewayConfig
from gateway.kvclient import AsyncKVClient
from gateway.metrics import Metrics
from gateway.prepare import ModelInfo
from gateway.router import OutputRouter

QUEUE_LENGTH_TTL_S = 0.05  # back-pressure reads XLEN at most this often
REDIS_MAX_CONNECTIONS = 256  # more concurrent commands wait for a free connection


@dataclass
class AppState:
    config: GatewayConfig
    model: ModelInfo
    admin_token: str | None
    metrics: Metrics
    _redis: redis.asyncio.Redis | None = None
    _kv: AsyncKVClient | None = None
    _router: OutputRouter | None = None
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
    def router(self) -> OutputRouter:
        assert self._router is not None, "the app is not running"
        return self._router

    async def connections(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup context: clients and the output reader live on the app's loop."""
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            self.config.redis_url, max_connections=REDIS_MAX_CONNECTIONS, timeout=None
        )
        self._redis = redis.asyncio.Redis(connection_pool=pool)
        self._kv = AsyncKVClient(self.config.kvstore, self.config.kvstore_timeout_s)
        self._router = OutputRouter(self._redis)
        reader = asyncio.create_task(self._router.run(), name="output-router")
        yield
        await self._router.stop(reader)
        await self._redis.aclose()
        await pool.aclose()
        self._kv.close()

    async def queue_length(self, fresh: bool = False) -> int:
        """Entries in the Redis request stream (waiting or in flight), re-read at most every
        ``QUEUE_LENGTH_TTL_S`` unless ``fresh``."""
        now = time.monotonic()
        if fresh or now - self._queue_length_at > QUEUE_LENGTH_TTL_S:
            self._queue_length = int(await self.redis.xlen(queue.REQUEST_STREAM))
            self._queue_length_at = now
        return self._queue_length


STATE = web.AppKey("state", AppState)
