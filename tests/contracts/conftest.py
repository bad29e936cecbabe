"""The Redis contract's tests' fixtures: a real Redis server through redis-py's reply shapes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from contracts import queue_worker


@pytest.fixture(params=["resp3", "resp2", "unified"])
def url(redis_url: str, request: pytest.FixtureRequest) -> str:
    """Redis for the contract's tests (``test_queue*.py``): the same server through redis-py's
    reply shapes: RESP3 (redis-py 8's default), RESP2, and
    RESP3 with redis-py's new unified replies."""
    query = {"resp3": "", "resp2": "?protocol=2", "unified": "?legacy_responses=false"}
    return redis_url + query[request.param]


@pytest.fixture
def r(url: str) -> Iterator[redis.Redis]:
    """A sync client of ``url`` on an empty database with the request group created."""
    client = redis.Redis.from_url(url)
    client.flushdb()
    queue_worker.ensure_group(client)
    yield client
    client.close()
