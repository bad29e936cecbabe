"""The gateway's routing (``gateway.routing.Routes``) against a real kvstore daemon of two pools:
concurrent requests are routed in batches and each gets the stream of the pool the kvstore chose;
a kvstore that does not answer leaves no request waiting for a route."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from contracts import queue_keys
from contracts.records import RequestRecord, SamplingParams
from gateway.kvclient import AsyncKVClient
from gateway.routing import Routes
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


def routes_of(endpoint: str, policy: p.RoutingPolicy, count: int, name: str) -> list[str]:
    async def go() -> list[str]:
        kv = AsyncKVClient(endpoint, timeout_s=5)
        try:
            routes = Routes(kv, policy)
            routes.pools = 2
            return list(
                await asyncio.gather(*(routes.stream_for(record(i, name)) for i in range(count)))
            )
        finally:
            kv.close()

    return asyncio.run(go())


def test_concurrent_requests_get_the_streams_the_kvstore_chose(two_pools: str) -> None:
    streams = [queue_keys.request_stream(0), queue_keys.request_stream(1)]
    assert routes_of(two_pools, "round_robin", 6, "rr") == streams * 3
    # by load: the kvstore counts each routed request as queued on its pool until admitted
    with KVClient(two_pools) as client:
        before = client.call(p.GetStats(0)).pools
    chosen = routes_of(two_pools, "least_loaded", 4, "ll")
    assert sorted(chosen) == sorted(streams * 2)
    with KVClient(two_pools) as client:
        after = client.call(p.GetStats(0)).pools
    assert [a.queued - b.queued for a, b in zip(after, before, strict=True)] == [2, 2]


def test_without_a_kvstore_requests_go_to_the_pools_in_turn() -> None:
    nobody = "ipc:///tmp/pagedserve-test-nobody-routes.sock"

    async def go() -> list[str]:
        kv = AsyncKVClient(nobody, timeout_s=0.3)
        try:
            routes = Routes(kv, "prefix")
            routes.pools = 2
            calls = (routes.stream_for(record(i)) for i in range(4))
            return list(await asyncio.wait_for(asyncio.gather(*calls), 10))
        finally:
            kv.close()

    chosen = asyncio.run(go())
    assert sorted(chosen) == sorted(
        [queue_keys.request_stream(0), queue_keys.request_stream(1)] * 2
    )


def test_one_pool_needs_no_route(two_pools: str) -> None:
    async def go() -> str:
        kv = AsyncKVClient("ipc:///tmp/pagedserve-test-nobody-routes.sock", timeout_s=0.1)
        try:
            return await Routes(kv, "prefix").stream_for(record(0))  # pools: 1 until told
        finally:
            kv.close()

    assert asyncio.run(go()) == queue_keys.REQUEST_STREAM
