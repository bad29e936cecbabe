"""The Redis contract (``contracts.queue_keys``, ``queue_worker``, ``queue_gateway``) against a
real Redis server: records, the happy path, aborts, cleanup, garbage. Taking requests over is in
``test_queue_takeover.py``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
import redis
import redis.asyncio

from contracts import queue_gateway, queue_keys, queue_worker
from contracts.records import (
    RECORD_VERSION,
    OutputRecord,
    RecordError,
    RequestRecord,
    SamplingParams,
    decode_output,
    decode_request,
    encode,
)
from tests.contracts.redis_contract import V, collect, request, run, submit_all


# ---------------------------------------------------------------- records
def test_records_round_trip() -> None:
    req = request("a", n=2, salt=b"\x00tenant", gateway="gateway-1")
    assert decode_request(encode(req)) == req
    out = OutputRecord("a", 1, [5, 6], "length", None, 3, 2, final=True, text="xy", offset=4)
    assert decode_output(encode(out)) == out
    err = OutputRecord("a", finish_reason="error", error="boom", final=True)
    assert decode_output(encode(err)) == err


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1garbage",
        encode(OutputRecord("a")),  # another record type
        msgspec.msgpack.encode(["req", "a", [1], {}, "tiny", None, "gw", "extra"]),
        msgspec.msgpack.encode(["req", "a", [1], {"n": 0}, "tiny"]),  # invalid params
        msgspec.msgpack.encode(["req", "a", [1], {"nope": 1}, "tiny"]),  # unknown field
    ],
)
def test_decode_request_rejects_clearly(data: bytes) -> None:
    with pytest.raises(RecordError, match=f"not a RequestRecord v{RECORD_VERSION}"):
        decode_request(data)


def test_decode_output_rejects_bad_finish_reason() -> None:
    data = msgspec.msgpack.encode(["out", "a", 0, [], "done"])
    with pytest.raises(RecordError, match=f"not an OutputRecord v{RECORD_VERSION}"):
        decode_output(data)


def test_key_names_are_namespaced() -> None:
    assert queue_keys.output_key("x") == "pagedserve:out:x"
    assert queue_keys.abort_key("x") == "pagedserve:abort:x"
    assert queue_keys.REQUEST_STREAM.startswith("pagedserve:")
    assert queue_keys.REQUEST_GROUP.startswith("pagedserve:")


def test_clients_must_return_bytes(redis_url: str) -> None:
    with pytest.raises(ValueError, match="decode_responses=False"):
        queue_worker.ensure_group(redis.Redis.from_url(redis_url, decode_responses=True))


# ---------------------------------------------------------------- the happy path
def test_submit_read_publish_stream(r: redis.Redis, url: str) -> None:
    run(submit_all(url, [request("a")]))
    [(entry_id, got)] = queue_worker.read_requests(r, "w1", count=10, block_ms=100)
    assert got == request("a")
    deltas = [
        OutputRecord("a", 0, [10], prompt_tokens=3, cached_tokens=0),
        OutputRecord("a", 0, [11, 12], prompt_tokens=3),
        OutputRecord("a", 0, [13], finish_reason="stop", prompt_tokens=3, final=True),
    ]
    commands: list[str] = []
    real_execute = r.execute_command

    def counting_execute(*args: Any, **kwargs: Any) -> Any:
        commands.append(args[0])
        return real_execute(*args, **kwargs)

    r.execute_command = counting_execute  # type: ignore[method-assign]
    queue_worker.publish(r, deltas)
    assert commands == ["EVAL"]  # all deltas and their TTLs: one command, one round trip
    del r.execute_command
    # one extra record after the final one: the reader must not see it
    r.xadd(
        queue_keys.output_key("a"),
        {"v": V, "rec": encode(OutputRecord("a", 0, [99]))},
    )
    assert run(collect(url, "a")) == deltas
    queue_worker.ack(r, [entry_id])
    assert r.xlen(queue_keys.REQUEST_STREAM) == 0
    assert r.xpending(queue_keys.REQUEST_STREAM, queue_keys.REQUEST_GROUP)["pending"] == 0


def test_stream_output_waits_for_deltas(r: redis.Redis, url: str) -> None:
    async def scenario() -> list[OutputRecord]:
        reader = asyncio.create_task(collect(url, "b", block_ms=50))
        await asyncio.sleep(0.15)  # several empty XREAD timeouts first
        queue_worker.publish(r, [OutputRecord("b", 0, [1])])
        await asyncio.sleep(0.05)
        queue_worker.publish(r, [OutputRecord("b", 0, [2], finish_reason="length", final=True)])
        return await asyncio.wait_for(reader, 5)

    assert [rec.token_ids for rec in run(scenario())] == [[1], [2]]


def test_publish_into_callers_pipeline_is_deferred(r: redis.Redis) -> None:
    pipe = r.pipeline(transaction=False)
    queue_worker.publish(pipe, [OutputRecord("c", 0, [1]), OutputRecord("d", 0, [2])])
    assert not r.exists(queue_keys.output_key("c"))
    pipe.execute()
    assert r.xlen(queue_keys.output_key("c")) == r.xlen(queue_keys.output_key("d")) == 1


def test_two_consumers_get_distinct_requests(r: redis.Redis, url: str) -> None:
    run(submit_all(url, [request(f"r{i}") for i in range(6)]))
    first = queue_worker.read_requests(r, "w1", count=3)
    second = queue_worker.read_requests(r, "w2", count=10)
    ids1 = {rec.req_id for _, rec in first}
    ids2 = {rec.req_id for _, rec in second}
    assert len(ids1) == 3 and not ids1 & ids2 and ids1 | ids2 == {f"r{i}" for i in range(6)}
    assert queue_worker.read_requests(r, "w3", count=10) == []


# ---------------------------------------------------------------- aborts and cleanup
def test_abort_is_seen_by_the_batched_check(r: redis.Redis, url: str) -> None:
    run(submit_all(url, [request(f"r{i}") for i in range(4)]))
    ids = [rec.req_id for _, rec in queue_worker.read_requests(r, "w1", count=10)]

    async def abort_two() -> None:
        ar = redis.asyncio.Redis.from_url(url)
        await queue_gateway.abort(ar, "r1")
        await queue_gateway.abort(ar, "r3")
        await ar.aclose()

    assert queue_worker.step(r, [], check_aborted=ids).aborted == set()
    run(abort_two())
    assert r.exists(queue_keys.abort_key("r1")) and not r.exists(queue_keys.abort_key("r0"))
    checked = queue_worker.step(r, [OutputRecord("r0", 0, [1])], check_aborted=ids)
    assert checked == queue_keys.Checked({"r1", "r3"}, set())
    assert queue_worker.step(r, []) == queue_keys.Checked(set(), set())
    assert 0 < r.ttl(queue_keys.abort_key("r1")) <= queue_keys.ABORT_TTL_S


def test_output_streams_expire(r: redis.Redis) -> None:
    queue_worker.publish(r, [OutputRecord("a", 0, [1])])
    assert (
        queue_keys.OUTPUT_TTL_S < r.ttl(queue_keys.output_key("a")) <= queue_keys.OUTPUT_IDLE_TTL_S
    )
    queue_worker.publish(r, [OutputRecord("a", 0, [2], finish_reason="stop", final=True)])
    assert 0 < r.ttl(queue_keys.output_key("a")) <= queue_keys.OUTPUT_TTL_S


# ---------------------------------------------------------------- garbage
def test_garbage_request_entries_are_skipped_answered_and_acked(r: redis.Redis, url: str) -> None:
    r.xadd(
        queue_keys.REQUEST_STREAM,
        {"v": V, "id": "junk", "rec": b"\xc1\xc1"},
    )
    r.xadd(queue_keys.REQUEST_STREAM, {"v": b"99", "id": "future", "rec": b""})
    r.xadd(
        queue_keys.REQUEST_STREAM, {"hello": "world"}
    )  # no req_id: can only be logged and dropped
    r.xadd(queue_keys.REQUEST_STREAM, {"v": V, "id": b"\xff", "rec": b""})  # not even UTF-8
    run(submit_all(url, [request("ok")]))
    got = queue_worker.read_requests(r, "w1", count=10)
    assert [rec.req_id for _, rec in got] == ["ok"]
    assert r.xlen(queue_keys.REQUEST_STREAM) == 1  # the three bad ones are acked and deleted
    [junk] = run(collect(url, "junk"))
    assert junk.finish_reason == "error" and junk.final and "malformed" in (junk.error or "")
    [future] = run(collect(url, "future"))
    assert "record version b'99'" in (future.error or "")


def test_garbage_output_entries(r: redis.Redis, url: str) -> None:
    queue_worker.publish(r, [OutputRecord("a", 0, [1])])
    r.xadd(queue_keys.output_key("a"), {"v": V, "rec": b"\xc1"})
    first, second = run(collect(url, "a"))  # the reader ends with an error, no exception
    assert first.token_ids == [1]
    assert (
        second.finish_reason == "error" and second.final and "OutputRecord" in (second.error or "")
    )
    with pytest.raises(RecordError, match="not an OutputRecord"):
        queue_worker.read_streamed(r, "a")


def test_submit_validates_params(url: str) -> None:
    bad = RequestRecord("x", [1], SamplingParams(top_p=0.0), "tiny")
    with pytest.raises(ValueError, match="top_p"):
        run(submit_all(url, [bad]))


def test_cancelled_reader_leaves_the_client_usable(r: redis.Redis, url: str) -> None:
    async def scenario() -> list[OutputRecord]:
        ar = redis.asyncio.Redis.from_url(url)
        try:

            async def first_record() -> OutputRecord:
                return await anext(queue_gateway.stream_output(ar, "gone", block_ms=10_000))

            reader = asyncio.create_task(first_record())
            await asyncio.sleep(0.1)
            reader.cancel()  # the client disconnected while XREAD was blocking
            with pytest.raises(asyncio.CancelledError):
                await reader
            await queue_gateway.abort(ar, "gone")
            queue_worker.publish(
                r, [OutputRecord("next", 0, [1], finish_reason="stop", final=True)]
            )
            return [rec async for rec in queue_gateway.stream_output(ar, "next", block_ms=100)]
        finally:
            await ar.aclose()

    assert [rec.token_ids for rec in run(scenario())] == [[1]]
    assert r.exists(queue_keys.abort_key("gone"))


def test_reader_recreates_a_lost_group(r: redis.Redis, url: str) -> None:
    r.flushdb()  # e.g. Redis restarted without persistence
    assert queue_worker.read_requests(r, "w1") == []
    run(submit_all(url, [request("a")]))
    assert [rec.req_id for _, rec in queue_worker.read_requests(r, "w1")] == ["a"]


def test_read_outputs_reads_many_streams_in_one_call_and_wakes(r: redis.Redis, url: str) -> None:
    async def scenario() -> tuple[list[tuple[str, str, OutputRecord]], float, list[str]]:
        ar = redis.asyncio.Redis.from_url(url)
        try:
            queue_worker.publish(
                r, [OutputRecord("a", 0, [1]), OutputRecord("b", 0, [2], final=True)]
            )
            r.xadd(
                queue_keys.output_key("b"),
                {"v": V, "rec": encode(OutputRecord("b", 0, [9]))},
            )
            got, wake = await queue_gateway.read_outputs(
                ar, {"a": "0-0", "b": "0-0", "c": "0-0"}, "g1"
            )
            # a blocked read returns as soon as its reader is woken, with nothing to read
            started = time.monotonic()
            reader = asyncio.create_task(
                queue_gateway.read_outputs(ar, {"c": "0-0"}, "g1", wake, 5000)
            )
            await asyncio.sleep(0.1)
            await queue_gateway.wake(ar, "g1")
            empty, _ = await asyncio.wait_for(reader, 5)
            waited = time.monotonic() - started
            # a wake sent before the read starts is not lost
            await queue_gateway.wake(ar, "g1")
            _, newer = await asyncio.wait_for(
                queue_gateway.read_outputs(ar, {}, "g1", wake, 5000), 1
            )
            r.xadd(queue_keys.output_key("c"), {"v": V, "rec": b"\xc1"})
            bad, _ = await queue_gateway.read_outputs(ar, {"c": "0-0"}, "g1", newer, 100)
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
    assert wakes[0] != wakes[1] and r.ttl(queue_keys.wake_key("g1")) > 0
