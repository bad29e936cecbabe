"""Dead workers and their requests, against a real Redis server: claiming what a dead worker left,
leases renewed by ``touch``, a request that kills its workers, a worker taking back its own,
gateways that went away."""

from __future__ import annotations

import time
from typing import Any

import redis
import redis.asyncio
from msgspec.structs import replace

from contracts import queue_gateway, queue_keys, queue_worker
from contracts.records import OutputRecord, RequestRecord, Streamed, StreamedSequence, encode
from tests.contracts.redis_contract import V, as_bytes, collect, request, run, submit_all


def test_dead_worker_requests_are_claimed_and_resumed(r: redis.Redis, url: str) -> None:
    run(submit_all(url, [request("a", n=2), request("b")]))
    taken = queue_worker.read_requests(r, "w1", count=10)
    assert [rec.req_id for _, rec in taken] == ["a", "b"]
    queue_worker.publish(r, [OutputRecord("a", 0, [10, 11]), OutputRecord("a", 1, [20])])
    queue_worker.publish(
        r, [OutputRecord("a", 0, [12], finish_reason="stop"), OutputRecord("a", 1, [21])]
    )
    # w1 dies here: no ack, no touch
    assert queue_worker.claim_stale(r, "w2", min_idle_ms=10_000) == []  # not idle long enough
    time.sleep(0.12)
    claimed = queue_worker.claim_stale(r, "w2", min_idle_ms=100)
    assert claimed == taken
    a = queue_worker.read_streamed(r, "a")
    assert a.sequences == {
        0: StreamedSequence([10, 11, 12], "stop"),
        1: StreamedSequence([20, 21], None),
    }
    assert not a.final
    assert queue_worker.read_streamed(r, "b") == Streamed({})
    # w2 resumes and finishes "a"; the gateway sees the whole output
    queue_worker.step(
        r, [OutputRecord("a", 1, [22], finish_reason="length", final=True)], [claimed[0][0]]
    )
    assert queue_worker.read_streamed(r, "a").final
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for record in run(collect(url, "a")):
        tokens[record.index] += record.token_ids
    assert tokens == {0: [10, 11, 12], 1: [20, 21, 22]}
    pending = r.xpending_range(queue_keys.REQUEST_STREAM, queue_keys.REQUEST_GROUP, "-", "+", 10)
    assert [(p["consumer"], p["times_delivered"]) for p in pending] == [(b"w2", 2)]


def test_touch_keeps_the_lease_and_reports_a_lost_one(r: redis.Redis, url: str) -> None:
    run(submit_all(url, [request("a"), request("b")]))
    ids = [entry_id for entry_id, _ in queue_worker.read_requests(r, "w1", count=10)]
    time.sleep(0.12)
    assert queue_worker.touch(r, "w1", ids) == ids  # w1 is alive: idle time reset
    assert queue_worker.claim_stale(r, "w2", min_idle_ms=100) == []
    time.sleep(0.12)
    assert queue_worker.touch(r, "w1", ids[:1]) == ids[:1]  # only "a" renewed
    assert [rec.req_id for _, rec in queue_worker.claim_stale(r, "w2", min_idle_ms=100)] == ["b"]
    assert queue_worker.touch(r, "w1", ids) == ids[:1]  # "b" now belongs to w2; w1 must drop it
    pending = r.xpending_range(queue_keys.REQUEST_STREAM, queue_keys.REQUEST_GROUP, "-", "+", 10)
    assert [p["times_delivered"] for p in pending] == [1, 2]  # touching is not a delivery
    assert queue_worker.touch(r, "w1", []) == []


def test_request_that_kills_workers_is_failed(r: redis.Redis, url: str) -> None:
    run(submit_all(url, [request("p")]))
    queue_worker.read_requests(r, "w0")  # delivery 1
    for worker in ("w1", "w2"):  # deliveries 2 and 3: still served
        time.sleep(0.03)
        assert len(queue_worker.claim_stale(r, worker, min_idle_ms=20, max_deliveries=3)) == 1
    time.sleep(0.03)
    assert queue_worker.claim_stale(r, "w3", min_idle_ms=20, max_deliveries=3) == []  # delivery 4
    [record] = run(collect(url, "p"))
    assert record.finish_reason == "error" and record.final
    assert "died while serving it, 3 times" in (record.error or "")
    assert r.xlen(queue_keys.REQUEST_STREAM) == 0


def test_a_worker_takes_its_own_pending_requests_back(r: redis.Redis, url: str) -> None:
    """``claim_own``: after a restart under the same name each request counts as a delivery
    (the poisonous one is failed, as by ``claim_stale``); after an outage in the same process it
    does not; a request another worker claimed meanwhile is not taken back; a deleted one is
    acked."""
    run(submit_all(url, [request(x) for x in "abcd"]))
    ids = [e for e, _ in queue_worker.read_requests(r, "w1", count=10)]
    assert [rec.req_id for _, rec in queue_worker.claim_own(r, "w1", redeliver=False)] == list(
        "abcd"
    )
    pending = r.xpending_range(queue_keys.REQUEST_STREAM, queue_keys.REQUEST_GROUP, "-", "+", 10)
    assert [p["times_delivered"] for p in pending] == [1, 1, 1, 1]
    time.sleep(0.05)
    assert [
        rec.req_id for _, rec in queue_worker.claim_stale(r, "w2", min_idle_ms=20, count=1)
    ] == ["a"]
    r.xdel(queue_keys.REQUEST_STREAM, ids[3])  # "d" deleted without an ack
    assert [rec.req_id for _, rec in queue_worker.claim_own(r, "w1", redeliver=True)] == ["b", "c"]
    assert (
        queue_worker.claim_own(r, "w2", redeliver=True, max_deliveries=2) == []
    )  # "a": delivery 3
    [failed] = run(collect(url, "a"))
    assert failed.finish_reason == "error" and "2 times" in (failed.error or "")
    pending = r.xpending_range(queue_keys.REQUEST_STREAM, queue_keys.REQUEST_GROUP, "-", "+", 10)
    assert [(p["consumer"], p["times_delivered"]) for p in pending] == [(b"w1", 2), (b"w1", 2)]


def test_dead_gateways_are_found_by_the_step(r: redis.Redis, url: str) -> None:
    async def renew() -> None:
        ar = redis.asyncio.Redis.from_url(url)
        await queue_gateway.renew_gateway(ar, "gw-alive", ttl_s=30)
        await queue_gateway.renew_gateway(ar, "gw-brief", ttl_s=0.05)
        await ar.aclose()

    run(renew())
    time.sleep(0.1)
    checked = queue_worker.step(r, [], check_gateways=["gw-alive", "gw-brief", "gw-never"])
    assert checked == queue_keys.Checked(set(), {"gw-brief", "gw-never"})


def test_claim_acks_entries_deleted_from_the_stream(r: redis.Redis, url: str) -> None:
    run(submit_all(url, [request("a"), request("b")]))
    (gone, _), (kept, _) = queue_worker.read_requests(r, "w1", count=10)
    r.xdel(queue_keys.REQUEST_STREAM, gone)  # trimmed without XACK (not by this module)
    time.sleep(0.03)
    assert [e for e, _ in queue_worker.claim_stale(r, "w2", min_idle_ms=20)] == [kept]
    pending = r.xpending_range(queue_keys.REQUEST_STREAM, queue_keys.REQUEST_GROUP, "-", "+", 10)
    assert [as_bytes(p["message_id"]).decode() for p in pending] == [kept]


def test_claim_accepts_redis7_reply_shape(r: redis.Redis) -> None:
    class Redis7:  # XAUTOCLAIM on Redis 7 adds the ids of deleted entries
        def __init__(self, inner: redis.Redis) -> None:
            self.inner = inner

        def xautoclaim(self, *args: Any, **kwargs: Any) -> list[Any]:
            return [*self.inner.xautoclaim(*args, **kwargs), [b"1-0"]]

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    entry_id = r.xadd(
        queue_keys.REQUEST_STREAM,
        {"v": V, "id": "a", "rec": encode(request("a"))},
    )
    queue_worker.read_requests(r, "w1")
    time.sleep(0.03)
    claimed = queue_worker.claim_stale(Redis7(r), "w2", min_idle_ms=20)  # type: ignore[arg-type]
    assert claimed == [(as_bytes(entry_id).decode(), request("a"))]


def test_stranded_requests_move_to_another_pools_stream_to_resume(r: redis.Redis, url: str) -> None:
    """``take_stranded`` takes what no live worker holds on a pool's stream (a dead worker's
    pending entry once idle long enough, and an entry never read) and ``move`` queues each on
    another pool's stream marked to resume, taking it off the first in the same transaction."""
    here, there = queue_keys.request_stream(1), queue_keys.request_stream(0)
    queue_worker.ensure_group(r, here)
    r.xadd(here, {"v": V, "id": "a", "rec": encode(request("a"))})
    r.xadd(here, {"v": V, "id": "b", "rec": encode(request("b"))})
    read = queue_worker.read_requests(r, "w1", count=1, stream=here)  # w1 takes "a", then dies
    assert [rec.req_id for _, rec in read] == ["a"]
    bad = as_bytes(r.xadd(here, {"v": V, "id": "bad", "rec": b"not a record"})).decode()

    async def take(min_idle_ms: int) -> list[tuple[str, RequestRecord]]:
        client = redis.asyncio.Redis.from_url(url)
        try:
            return await queue_gateway.take_stranded(client, here, "mover", min_idle_ms, 10)
        finally:
            await client.aclose()

    async def move_all(entries: list[tuple[str, RequestRecord]]) -> list[str]:
        client = redis.asyncio.Redis.from_url(url)
        try:
            return [await queue_gateway.move(client, e, rec, here, there) for e, rec in entries]
        finally:
            await client.aclose()

    assert [rec.req_id for _, rec in run(take(60_000))] == ["b"]  # "a": w1's, not idle yet
    time.sleep(0.12)
    stranded = run(take(100))
    assert [rec.req_id for _, rec in stranded] == ["a", "b"]  # "b" again: the mover's, idle
    pending = r.xpending_range(here, queue_keys.REQUEST_GROUP, "-", "+", 10)
    assert sorted(p["consumer"] for p in pending) == [b"mover"] * 3  # the malformed one too

    new_ids = run(move_all(stranded))
    assert r.xlen(here) == 1  # the malformed entry stays, for a worker to fail
    left = r.xpending_range(here, queue_keys.REQUEST_GROUP, "-", "+", 10)
    assert [queue_keys.text(p["message_id"]) for p in left] == [bad]
    moved = queue_worker.read_requests(r, "w0", count=10, stream=there)
    assert [entry_id for entry_id, _ in moved] == new_ids
    assert sorted((rec.req_id, rec.resume) for _, rec in moved) == [("a", True), ("b", True)]
    assert all(rec == replace(request(rec.req_id), resume=True) for _, rec in moved)
