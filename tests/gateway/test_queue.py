"""The Redis contract (gateway/queue.py) against a real Redis server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import msgspec
import pytest
import redis
import redis.asyncio

from gateway import queue as q
from gateway.queue import OutputRecord, RequestRecord, SamplingParams


def request(req_id: str, n: int = 1, **kw: object) -> RequestRecord:
    params = SamplingParams(max_tokens=8, n=n, stop=["\n"], stop_token_ids=[2], seed=7)
    return RequestRecord(req_id, [1, 2, 3], params, "tiny", 1_700_000_000.5, **kw)  # type: ignore[arg-type]


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def submit_all(url: str, records: list[RequestRecord]) -> list[str]:
    r = redis.asyncio.Redis.from_url(url)
    try:
        return [await q.submit(r, record) for record in records]
    finally:
        await r.aclose()


async def collect(url: str, req_id: str, block_ms: int = 200) -> list[OutputRecord]:
    r = redis.asyncio.Redis.from_url(url)
    try:
        return [record async for record in q.stream_output(r, req_id, block_ms=block_ms)]
    finally:
        await r.aclose()


@pytest.fixture(params=["resp3", "resp2", "unified"])
def url(redis_url: str, request: pytest.FixtureRequest) -> str:
    """The same server through redis-py's reply shapes: RESP3 (redis-py 8's default), RESP2, and
    RESP3 with redis-py's new unified replies."""
    query = {"resp3": "", "resp2": "?protocol=2", "unified": "?legacy_responses=false"}
    return redis_url + query[request.param]


@pytest.fixture
def r(url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(url)
    client.flushdb()
    q.ensure_group(client)
    yield client
    client.close()


# ---------------------------------------------------------------- records
def test_records_round_trip() -> None:
    req = request("a", n=2, salt=b"\x00tenant", priority=-1)
    assert q.decode_request(q.encode(req)) == req
    out = OutputRecord("a", 1, [5, 6], [-0.5, -1.25], "length", None, 3, 2, final=True)
    assert q.decode_output(q.encode(out)) == out
    err = OutputRecord("a", finish_reason="error", error="boom", final=True)
    assert q.decode_output(q.encode(err)) == err


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1garbage",
        q.encode(OutputRecord("a")),  # another record type
        msgspec.msgpack.encode(["req", "a", [1], {}, "tiny", 0.0, None, 0, "gw", "extra"]),
        msgspec.msgpack.encode(["req", "a", [1], {"n": 0}, "tiny", 0.0]),  # invalid params
        msgspec.msgpack.encode(["req", "a", [1], {"nope": 1}, "tiny", 0.0]),  # unknown field
    ],
)
def test_decode_request_rejects_clearly(data: bytes) -> None:
    with pytest.raises(q.RecordError, match="not a RequestRecord v1"):
        q.decode_request(data)


def test_decode_output_rejects_bad_finish_reason() -> None:
    data = msgspec.msgpack.encode(["out", "a", 0, [], None, "done"])
    with pytest.raises(q.RecordError, match="not an OutputRecord v1"):
        q.decode_output(data)


def test_key_names_are_namespaced() -> None:
    assert q.output_key("x") == "pagedserve:out:x"
    assert q.abort_key("x") == "pagedserve:abort:x"
    assert q.REQUEST_STREAM.startswith("pagedserve:")
    assert q.REQUEST_GROUP.startswith("pagedserve:")


def test_clients_must_return_bytes(redis_url: str) -> None:
    with pytest.raises(ValueError, match="decode_responses=False"):
        q.ensure_group(redis.Redis.from_url(redis_url, decode_responses=True))


# ---------------------------------------------------------------- the happy path
def test_submit_read_publish_stream(r: redis.Redis, url: str) -> None:
    run(submit_all(url, [request("a")]))
    [(entry_id, got)] = q.read_requests(r, "w1", count=10, block_ms=100)
    assert got == request("a")
    deltas = [
        OutputRecord("a", 0, [10], prompt_tokens=3, cached_tokens=0),
        OutputRecord("a", 0, [11, 12], prompt_tokens=3),
        OutputRecord("a", 0, [13], finish_reason="stop", prompt_tokens=3, final=True),
    ]
    commands: list[str] = []
    real_execute = r.execute_command

    def counting_execute(*args, **kwargs):  # type: ignore[no-untyped-def]
        commands.append(args[0])
        return real_execute(*args, **kwargs)

    r.execute_command = counting_execute  # type: ignore[method-assign]
    q.publish(r, deltas)
    assert commands == ["EVAL"]  # all deltas and their TTLs: one command, one round trip
    del r.execute_command
    # one extra record after the final one: the reader must not see it
    r.xadd(q.output_key("a"), {"v": b"1", "rec": q.encode(OutputRecord("a", 0, [99]))})
    assert run(collect(url, "a")) == deltas
    q.ack(r, [entry_id])
    assert r.xlen(q.REQUEST_STREAM) == 0
    assert r.xpending(q.REQUEST_STREAM, q.REQUEST_GROUP)["pending"] == 0


def test_stream_output_waits_for_deltas(r: redis.Redis, url: str) -> None:
    async def scenario() -> list[OutputRecord]:
        reader = asyncio.create_task(collect(url, "b", block_ms=50))
        await asyncio.sleep(0.15)  # several empty XREAD timeouts first
        q.publish(r, [OutputRecord("b", 0, [1])])
        await asyncio.sleep(0.05)
        q.publish(r, [OutputRecord("b", 0, [2], finish_reason="length", final=True)])
        return await asyncio.wait_for(reader, 5)

    assert [rec.token_ids for rec in run(scenario())] == [[1], [2]]


def test_publish_into_callers_pipeline_is_deferred(r: redis.Redis) -> None:
    pipe = r.pipeline(transaction=False)
    q.publish(pipe, [OutputRecord("c", 0, [1]), OutputRecord("d", 0, [2])])
    assert not r.exists(q.output_key("c"))
    pipe.execute()
    assert r.xlen(q.output_key("c")) == r.xlen(q.output_key("d")) == 1


def test_two_consumers_get_distinct_requests(r: redis.Redis, url: str) -> None:
    run(submit_all(url, [request(f"r{i}") for i in range(6)]))
    first = q.read_requests(r, "w1", count=3)
    second = q.read_requests(r, "w2", count=10)
    ids1 = {rec.req_id for _, rec in first}
    ids2 = {rec.req_id for _, rec in second}
    assert len(ids1) == 3 and not ids1 & ids2 and ids1 | ids2 == {f"r{i}" for i in range(6)}
    assert q.read_requests(r, "w3", count=10) == []


# ---------------------------------------------------------------- dead workers
def test_dead_worker_requests_are_claimed_and_resumed(r: redis.Redis, url: str) -> None:
    run(submit_all(url, [request("a", n=2), request("b")]))
    taken = q.read_requests(r, "w1", count=10)
    assert [rec.req_id for _, rec in taken] == ["a", "b"]
    q.publish(r, [OutputRecord("a", 0, [10, 11]), OutputRecord("a", 1, [20])])
    q.publish(r, [OutputRecord("a", 0, [12], finish_reason="stop"), OutputRecord("a", 1, [21])])
    # w1 dies here: no ack, no touch
    assert q.claim_stale(r, "w2", min_idle_ms=10_000) == []  # not idle long enough
    time.sleep(0.12)
    claimed = q.claim_stale(r, "w2", min_idle_ms=100)
    assert claimed == taken
    a = q.read_streamed(r, "a")
    assert a.sequences == {
        0: q.StreamedSequence([10, 11, 12], "stop"),
        1: q.StreamedSequence([20, 21], None),
    }
    assert not a.final
    assert q.read_streamed(r, "b") == q.Streamed({})
    # w2 resumes and finishes "a"; the gateway sees the whole output
    q.step(r, [OutputRecord("a", 1, [22], finish_reason="length", final=True)], [claimed[0][0]])
    assert q.read_streamed(r, "a").final
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for record in run(collect(url, "a")):
        tokens[record.index] += record.token_ids
    assert tokens == {0: [10, 11, 12], 1: [20, 21, 22]}
    pending = r.xpending_range(q.REQUEST_STREAM, q.REQUEST_GROUP, "-", "+", 10)
    assert [(p["consumer"], p["times_delivered"]) for p in pending] == [(b"w2", 2)]


def test_touch_keeps_the_lease_and_reports_a_lost_one(r: redis.Redis, url: str) -> None:
    run(submit_all(url, [request("a"), request("b")]))
    ids = [entry_id for entry_id, _ in q.read_requests(r, "w1", count=10)]
    time.sleep(0.12)
    assert q.touch(r, "w1", ids) == ids  # w1 is alive: idle time reset
    assert q.claim_stale(r, "w2", min_idle_ms=100) == []
    time.sleep(0.12)
    assert q.touch(r, "w1", ids[:1]) == ids[:1]  # only "a" renewed
    assert [rec.req_id for _, rec in q.claim_stale(r, "w2", min_idle_ms=100)] == ["b"]
    assert q.touch(r, "w1", ids) == ids[:1]  # "b" now belongs to w2; w1 must drop it
    pending = r.xpending_range(q.REQUEST_STREAM, q.REQUEST_GROUP, "-", "+", 10)
    assert [p["times_delivered"] for p in pending] == [1, 2]  # touching is not a delivery
    assert q.touch(r, "w1", []) == []


def test_request_that_kills_workers_is_failed(r: redis.Redis, url: str) -> None:
    run(submit_all(url, [request("p")]))
    q.read_requests(r, "w0")  # delivery 1
    for worker in ("w1", "w2"):  # deliveries 2 and 3: still served
        time.sleep(0.03)
        assert len(q.claim_stale(r, worker, min_idle_ms=20, max_deliveries=3)) == 1
    time.sleep(0.03)
    assert q.claim_stale(r, "w3", min_idle_ms=20, max_deliveries=3) == []  # delivery 4
    [record] = run(collect(url, "p"))
    assert record.finish_reason == "error" and record.final and "4 times" in (record.error or "")
    assert r.xlen(q.REQUEST_STREAM) == 0


def test_a_worker_takes_its_own_pending_requests_back(r: redis.Redis, url: str) -> None:
    """``claim_own``: after a restart under the same name each request counts as a delivery
    (the poisonous one is failed, as by ``claim_stale``); after an outage in the same process it
    does not; a request another worker claimed meanwhile is not taken back; a deleted one is
    acked."""
    run(submit_all(url, [request(x) for x in "abcd"]))
    ids = [e for e, _ in q.read_requests(r, "w1", count=10)]
    assert [rec.req_id for _, rec in q.claim_own(r, "w1", redeliver=False)] == list("abcd")
    pending = r.xpending_range(q.REQUEST_STREAM, q.REQUEST_GROUP, "-", "+", 10)
    assert [p["times_delivered"] for p in pending] == [1, 1, 1, 1]
    time.sleep(0.05)
    assert [rec.req_id for _, rec in q.claim_stale(r, "w2", min_idle_ms=20, count=1)] == ["a"]
    r.xdel(q.REQUEST_STREAM, ids[3])  # "d" deleted without an ack
    assert [rec.req_id for _, rec in q.claim_own(r, "w1", redeliver=True)] == ["b", "c"]
    assert q.claim_own(r, "w2", redeliver=True, max_deliveries=2) == []  # "a": delivery 3
    [failed] = run(collect(url, "a"))
    assert failed.finish_reason == "error" and "3 times" in (failed.error or "")
    pending = r.xpending_range(q.REQUEST_STREAM, q.REQUEST_GROUP, "-", "+", 10)
    assert [(p["consumer"], p["times_delivered"]) for p in pending] == [(b"w1", 2), (b"w1", 2)]


def test_dead_gateways_are_found_by_the_step(r: redis.Redis, url: str) -> None:
    async def renew() -> None:
        ar = redis.asyncio.Redis.from_url(url)
        await q.renew_gateway(ar, "gw-alive", ttl_s=30)
        await q.renew_gateway(ar, "gw-brief", ttl_s=0.05)
        await ar.aclose()

    run(renew())
    time.sleep(0.1)
    checked = q.step(r, [], check_gateways=["gw-alive", "gw-brief", "gw-never"])
    assert checked == q.Checked(set(), {"gw-brief", "gw-never"})


def test_claim_acks_entries_deleted_from_the_stream(r: redis.Redis, url: str) -> None:
    run(submit_all(url, [request("a"), request("b")]))
    (gone, _), (kept, _) = q.read_requests(r, "w1", count=10)
    r.xdel(q.REQUEST_STREAM, gone)  # trimmed without XACK (not by this module)
    time.sleep(0.03)
    assert [e for e, _ in q.claim_stale(r, "w2", min_idle_ms=20)] == [kept]
    pending = r.xpending_range(q.REQUEST_STREAM, q.REQUEST_GROUP, "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [kept]


def test_claim_accepts_redis7_reply_shape(r: redis.Redis) -> None:
    class Redis7:  # XAUTOCLAIM on Redis 7 adds the ids of deleted entries
        def __init__(self, inner: redis.Redis) -> None:
            self.inner = inner

        def xautoclaim(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return [*self.inner.xautoclaim(*args, **kwargs), [b"1-0"]]

        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(self.inner, name)

    entry_id = r.xadd(q.REQUEST_STREAM, {"v": b"1", "id": "a", "rec": q.encode(request("a"))})
    q.read_requests(r, "w1")
    time.sleep(0.03)
    claimed = q.claim_stale(Redis7(r), "w2", min_idle_ms=20)  # type: ignore[arg-type]
    assert claimed == [(entry_id.decode(), request("a"))]


# ---------------------------------------------------------------- aborts and cleanup
def test_abort_is_seen_by_the_batched_check(r: redis.Redis, url: str) -> None:
    run(submit_all(url, [request(f"r{i}") for i in range(4)]))
    ids = [rec.req_id for _, rec in q.read_requests(r, "w1", count=10)]

    async def abort_two() -> None:
        ar = redis.asyncio.Redis.from_url(url)
        await q.abort(ar, "r1")
        await q.abort(ar, "r3")
        await ar.aclose()

    assert q.aborted(r, ids) == set()
    run(abort_two())
    assert q.aborted(r, ids) == {"r1", "r3"}
    assert q.is_aborted(r, "r1") and not q.is_aborted(r, "r0")
    checked = q.step(r, [OutputRecord("r0", 0, [1])], check_aborted=ids)
    assert checked == q.Checked({"r1", "r3"}, set())
    assert q.step(r, []) == q.Checked(set(), set())
    assert 0 < r.ttl(q.abort_key("r1")) <= q.ABORT_TTL_S


def test_output_streams_expire(r: redis.Redis) -> None:
    q.publish(r, [OutputRecord("a", 0, [1])])
    assert q.OUTPUT_TTL_S < r.ttl(q.output_key("a")) <= q.OUTPUT_IDLE_TTL_S
    q.publish(r, [OutputRecord("a", 0, [2], finish_reason="stop", final=True)])
    assert 0 < r.ttl(q.output_key("a")) <= q.OUTPUT_TTL_S


# ---------------------------------------------------------------- garbage
def test_garbage_request_entries_are_skipped_answered_and_acked(r: redis.Redis, url: str) -> None:
    r.xadd(q.REQUEST_STREAM, {"v": b"1", "id": "junk", "rec": b"\xc1\xc1"})
    r.xadd(q.REQUEST_STREAM, {"v": b"2", "id": "future", "rec": b""})
    r.xadd(q.REQUEST_STREAM, {"hello": "world"})  # no req_id: can only be logged and dropped
    r.xadd(q.REQUEST_STREAM, {"v": b"1", "id": b"\xff", "rec": b""})  # not even UTF-8
    run(submit_all(url, [request("ok")]))
    got = q.read_requests(r, "w1", count=10)
    assert [rec.req_id for _, rec in got] == ["ok"]
    assert r.xlen(q.REQUEST_STREAM) == 1  # the three bad ones are acked and deleted
    [junk] = run(collect(url, "junk"))
    assert junk.finish_reason == "error" and junk.final and "malformed" in (junk.error or "")
    [future] = run(collect(url, "future"))
    assert "record version b'2'" in (future.error or "")


def test_garbage_output_entries(r: redis.Redis, url: str) -> None:
    q.publish(r, [OutputRecord("a", 0, [1])])
    r.xadd(q.output_key("a"), {"v": b"1", "rec": b"\xc1"})
    first, second = run(collect(url, "a"))  # the reader ends with an error, no exception
    assert first.token_ids == [1]
    assert second.finish_reason == "error" and second.final and "OutputRecord" in second.error  # type: ignore[operator]
    with pytest.raises(q.RecordError, match="not an OutputRecord"):
        q.read_streamed(r, "a")


def test_submit_validates_params(url: str) -> None:
    bad = RequestRecord("x", [1], SamplingParams(top_p=0.0), "tiny", 0.0)
    with pytest.raises(ValueError, match="top_p"):
        run(submit_all(url, [bad]))


def test_cancelled_reader_leaves_the_client_usable(r: redis.Redis, url: str) -> None:
    async def scenario() -> list[OutputRecord]:
        ar = redis.asyncio.Redis.from_url(url)
        try:
            reader = asyncio.create_task(anext(q.stream_output(ar, "gone", block_ms=10_000)))
            await asyncio.sleep(0.1)
            reader.cancel()  # the client disconnected while XREAD was blocking
            with pytest.raises(asyncio.CancelledError):
                await reader
            await q.abort(ar, "gone")
            q.publish(r, [OutputRecord("next", 0, [1], finish_reason="stop", final=True)])
            return [rec async for rec in q.stream_output(ar, "next", block_ms=100)]
        finally:
            await ar.aclose()

    assert [rec.token_ids for rec in run(scenario())] == [[1]]
    assert q.is_aborted(r, "gone")


def test_reader_recreates_a_lost_group(r: redis.Redis, url: str) -> None:
    r.flushdb()  # e.g. Redis restarted without persistence
    assert q.read_requests(r, "w1") == []
    run(submit_all(url, [request("a")]))
    assert [rec.req_id for _, rec in q.read_requests(r, "w1")] == ["a"]


def test_read_outputs_reads_many_streams_in_one_call_and_wakes(r: redis.Redis, url: str) -> None:
    async def scenario() -> tuple[list[tuple[str, str, OutputRecord]], float, list[str]]:
        ar = redis.asyncio.Redis.from_url(url)
        try:
            q.publish(r, [OutputRecord("a", 0, [1]), OutputRecord("b", 0, [2], final=True)])
            r.xadd(q.output_key("b"), {"v": b"1", "rec": q.encode(OutputRecord("b", 0, [9]))})
            got, wake = await q.read_outputs(ar, {"a": "0-0", "b": "0-0", "c": "0-0"}, "g1")
            # a blocked read returns as soon as its reader is woken, with nothing to read
            started = time.monotonic()
            reader = asyncio.create_task(q.read_outputs(ar, {"c": "0-0"}, "g1", wake, 5000))
            await asyncio.sleep(0.1)
            await q.wake(ar, "g1")
            empty, _ = await asyncio.wait_for(reader, 5)
            waited = time.monotonic() - started
            # a wake sent before the read starts is not lost
            await q.wake(ar, "g1")
            _, newer = await asyncio.wait_for(q.read_outputs(ar, {}, "g1", wake, 5000), 1)
            r.xadd(q.output_key("c"), {"v": b"1", "rec": b"\xc1"})
            bad, _ = await q.read_outputs(ar, {"c": "0-0"}, "g1", newer, 100)
            return got + empty + bad, waited, [wake, newer]
        finally:
            await ar.aclose()

    records, waited, wakes = run(scenario())
    # per stream in order, nothing after a final record, then the malformed entry as an error
    assert [(req_id, rec.token_ids, rec.final) for req_id, _, rec in records[:2]] == [
        ("a", [1], False),
        ("b", [2], True),
    ]
    assert records[2][0] == "c" and records[2][2].finish_reason == "error" and records[2][2].final
    assert len(records) == 3 and waited < 2
    assert wakes[0] != wakes[1] and r.ttl(q.wake_key("g1")) > 0
