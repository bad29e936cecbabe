"""An asyncio client of the kvstore daemon (zmq.asyncio DEALER) over ``kvstore.protocol``.

The gateway's calls are rare (health checks, scrapes, admin pages), so one call is outstanding at
a time (a lock); a reply that comes after its call timed out is skipped by ``call_id``, as the
synchronous ``kvstore.client.KVClient`` does. Errors are that client's exceptions.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import overload

import zmq
import zmq.asyncio

from contracts.endpoints import env_token
from kvstore import protocol as p
from kvstore.client import KVStoreError, KVStoreTimeout, expect_reply

__all__ = ["AsyncKVClient", "KVStoreError", "KVStoreTimeout"]


class AsyncKVClient:
    def __init__(self, endpoint: str, timeout_s: float = 2.0, token: str | None = None) -> None:
        """``token``: sent with every call; None reads ``$PAGEDSERVE_KVSTORE_TOKEN``."""
        self.endpoint = endpoint
        self._token = env_token() if token is None else token
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    @overload
    async def call(self, body: p.Register, timeout_s: float | None = None) -> p.Registered: ...
    @overload
    async def call(
        self, body: p.Heartbeat | p.Unregister, timeout_s: float | None = None
    ) -> p.Ack: ...
    @overload
    async def call(self, body: p.Step, timeout_s: float | None = None) -> p.StepReply: ...
    @overload
    async def call(self, body: p.GetStats, timeout_s: float | None = None) -> p.Stats: ...
    @overload
    async def call(self, body: p.ResetCache, timeout_s: float | None = None) -> p.CacheReset: ...
    @overload
    async def call(self, body: p.Ping, timeout_s: float | None = None) -> p.Pong: ...
    @overload
    async def call(self, body: p.GetBlockMap, timeout_s: float | None = None) -> p.BlockMap: ...
    @overload
    async def call(self, body: p.GetBlockInfo, timeout_s: float | None = None) -> p.BlockInfo: ...
    @overload
    async def call(self, body: p.Route, timeout_s: float | None = None) -> p.Routed: ...
    async def call(self, body: p.Request, timeout_s: float | None = None) -> p.ReplyBody:
        """The reply to ``body`` (``p.REPLY_OF``); raises KVStoreError on an Error reply or a
        reply of another kind, KVStoreTimeout when none comes within ``timeout_s`` (default: the
        client's)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        async with self._lock:
            call_id = next(self._ids)
            await self._sock.send(p.encode(p.Call(p.PROTOCOL_VERSION, call_id, body, self._token)))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                remaining_ms = int(max(deadline - loop.time(), 0) * 1000)
                if not remaining_ms or not await self._sock.poll(remaining_ms):  # POLLIN
                    raise KVStoreTimeout(f"no reply from {self.endpoint} in {timeout} s")
                reply = p.decode_reply(await self._sock.recv())
                if reply.call_id in (call_id, 0):
                    break
        return expect_reply(body, reply.body)

    async def stats(self, top_prefixes: int = 10) -> p.Stats:
        return await self.call(p.GetStats(top_prefixes))

    def close(self) -> None:
        self._sock.close()
