"""The engine's pipelined Redis output (``compute.loop.publisher``), against a real Redis."""

from __future__ import annotations

import pytest
import redis

from compute.loop.publisher import Publisher, Replies, resp_commands
from contracts import queue_keys, queue_worker
from contracts.records import OutputRecord
from tests.conftest import entry_record
from tests.contracts.redis_contract import V, collect, request, run, submit_all


def test_resp_commands_are_what_redis_py_sends() -> None:
    commands: list[tuple[object, ...]] = [
        ("EVAL", "return 1", 2, "k1", "ké", b"\x00\xff\r\n", 5, 300),
        ("MGET", "a", "b"),
        ("XACK", "s", "g", "1-0"),
    ]
    assert resp_commands(commands) == b"".join(redis.Connection().pack_commands(commands))


def test_jobs_reach_redis_in_order_and_what_they_found_comes_from_collect(
    redis_url: str,
) -> None:
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    r.set(queue_keys.abort_key("gone"), 1)
    r.set(queue_keys.gateway_key("alive-gw"), 1)
    publisher = Publisher(r, "w1", check_every_s=0.0)
    first = [OutputRecord("req-a", 0, [7], text="x", offset=0)]
    publisher.submit(first, [], ["gone", "kept"], ["alive-gw", "dead-gw"])
    with pytest.raises(RuntimeError, match="collect"):  # its replies would be lost
        publisher.submit(first, [], [], [])
    checked = publisher.collect().checked
    second = [OutputRecord("req-a", 0, [8], text="y", offset=1, final=True)]
    publisher.submit(second, [], [], [])
    assert checked is not None
    assert checked.aborted == {"gone"} and checked.gateways_gone == {"dead-gw"}
    assert publisher.collect() == Replies()  # the second job checked nothing
    assert publisher.idle
    entries = r.xrange(queue_keys.output_key("req-a"))
    assert entries is not None
    assert [entry_record(e).token_ids for e in entries] == [[7], [8]]  # in order, both there
    publisher.close()


@pytest.mark.parametrize("query", ["", "?protocol=2", "?legacy_responses=false"])
def test_a_job_reads_new_requests_for_its_consumer_and_they_come_a_job_later(
    redis_url: str, query: str
) -> None:
    url = redis_url + query  # each reply shape redis-py may hand the raw reader
    r = redis.Redis.from_url(url)
    r.flushdb()
    queue_worker.ensure_group(r)
    run(submit_all(url, [request("a"), request("b")]))
    r.xadd(queue_keys.REQUEST_STREAM, {"v": V, "id": "junk", "rec": b"\xc1"})
    run(submit_all(url, [request("c")]))
    publisher = Publisher(r, "w1", check_every_s=0.0)
    publisher.submit([], [], [], [], read=2)
    found = publisher.collect()
    assert [record.req_id for _, record in found.requests] == ["a", "b"]
    publisher.submit([], [], ["a"], [], read=10)
    found = publisher.collect()
    assert [record.req_id for _, record in found.requests] == ["c"]
    pending = r.xpending_range(queue_keys.REQUEST_STREAM, queue_keys.REQUEST_GROUP, "-", "+", 9)
    assert [p["consumer"] for p in pending] == [b"w1"] * 3  # a, b, c: junk was acked
    assert found.checked is not None and found.checked.aborted == set()
    [junk] = run(collect(url, "junk"))  # failed with an error record, as read_requests does
    assert junk.finish_reason == "error" and "malformed" in (junk.error or "")
    publisher.submit([], [], [], [], read=0)
    assert publisher.idle  # nothing to send: no job

    r.flushdb()  # a Redis restarted without its data: the group is gone
    publisher.submit([], [], [], [], read=5)
    assert publisher.collect() == Replies()
    run(submit_all(url, [request("d")]))  # the group was made again: d is read
    publisher.submit([], [], [], [], read=5)
    assert [record.req_id for _, record in publisher.collect().requests] == ["d"]
    publisher.close()
