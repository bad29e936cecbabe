"""The gateway's routing (``gateway.routing.Routes``) against a real kvstore daemon of two pools:
concurrent requests are routed in batches and each gets the pool the kvstore chose;
a kvstore that does not answer leaves no request waiting for a route."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from contracts.records import RequestRecord, SamplingParams
from gateway.kvclient import AsyncKVClient
from gateway.routing import Placement, Routes
from kvstore import protocol as p
from kvstore.client import KVClient
from tests.conftest import start_kvstore, stop_process


@pytest.fixture(scope="module")
def two_pools() -> Iterator[str]:
    process, endpoint = start_kvstore(
        "--model", "tiny", "--kv-memory", "0.001GiB", "--data-parallel-size", "2"
    )
    try:
        yield endpoint
    finally:
        stop_process(process)


def record(i: int, name: str = "r") -> RequestRecord:
    return RequestRecord(f"{name}{i}", [i + 1] * 20, SamplingParams(), "tiny")


def routes_of(endpoint: str, policy: p.RoutingPolicy, count: int, name: str) -> list[int]:
    async def go() -> list[int]:
        kv = AsyncKVClient(endpoint, timeout_s=5)
        try:
            routes = Routes(kv, policy)
            routes.pools = 2
            calls = (routes.pool_for(record(i, name)) for i in range(count))
            return [placement.pool for placement in await asyncio.gather(*calls)]
        finally:
            kv.close()

    return asyncio.run(go())


def test_concurrent_requests_get_the_pools_the_kvstore_chose(two_pools: str) -> None:
    assert routes_of(two_pools, "round_robin", 6, "rr") == [0, 1] * 3
    # by load: the kvstore counts each routed request as queued on its pool until admitted
    with KVClient(two_pools) as client:
        before = client.call(p.GetStats(0)).pools
    chosen = routes_of(two_pools, "least_loaded", 4, "ll")
    assert sorted(chosen) == [0, 0, 1, 1]
    with KVClient(two_pools) as client:
        after = client.call(p.GetStats(0)).pools
    assert [a.queued - b.queued for a, b in zip(after, before, strict=True)] == [2, 2]


def test_without_a_kvstore_requests_go_to_the_pools_in_turn() -> None:
    nobody = "ipc:///tmp/pagedserve-test-nobody-routes.sock"

    async def go() -> list[int]:
        kv = AsyncKVClient(nobody, timeout_s=0.3)
        try:
            routes = Routes(kv, "prefix")
            routes.pools = 2
            calls = (routes.pool_for(record(i)) for i in range(4))
            placed = await asyncio.wait_for(asyncio.gather(*calls), 10)
            return [placement.pool for placement in placed]
        finally:
            kv.close()

    chosen = asyncio.run(go())
    assert sorted(chosen) == [0, 0, 1, 1]


def test_one_pool_needs_no_route(two_pools: str) -> None:
    async def go() -> Placement:
        kv = AsyncKVClient("ipc:///tmp/pagedserve-test-nobody-routes.sock", timeout_s=0.1)
        try:
            return await Routes(kv, "prefix").pool_for(record(0))  # pools: 1 until told
        finally:
            kv.close()

    assert asyncio.run(go()) == Placement("", 0)
