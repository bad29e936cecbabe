"""What the Redis-contract tests share: records and small async helpers (their fixtures, ``url``
and ``r``, are in ``tests/contracts/conftest.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import redis
import redis.asyncio

from contracts import queue_gateway, queue_keys
from contracts.records import OutputRecord, RequestRecord, SamplingParams

V = queue_keys.RECORD_FIELD_VERSION  # the ``v`` field of entries this build reads


T = TypeVar("T")


def request(req_id: str, n: int = 1, salt: bytes | None = None, gateway: str = "") -> RequestRecord:
    params = SamplingParams(max_tokens=8, n=n, stop=["\n"], stop_token_ids=[2], seed=7)
    return RequestRecord(req_id, [1, 2, 3], params, "tiny", salt=salt, gateway=gateway)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def as_bytes(value: object) -> bytes:
    """A reply field that redis-py types as a union: bytes for these clients
    (``decode_responses=False``, which ``queue_keys.check_bytes`` requires)."""
    assert isinstance(value, bytes), value
    return value


async def submit_all(url: str, records: list[RequestRecord]) -> list[str]:
    r = redis.asyncio.Redis.from_url(url)
    try:
        return [await queue_gateway.submit(r, record) for record in records]
    finally:
        await r.aclose()


async def collect(url: str, req_id: str, block_ms: int = 200) -> list[OutputRecord]:
    r = redis.asyncio.Redis.from_url(url)
    try:
        return [
            record async for record in queue_gateway.stream_output(r, req_id, block_ms=block_ms)
        ]
    finally:
        await r.aclose()
