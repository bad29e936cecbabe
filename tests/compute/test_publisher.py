"""The engine's pipelined Redis output (``compute.publisher``), against a real Redis."""

from __future__ import annotations

import redis

from compute.publisher import Publisher, resp_commands
from contracts import queue_keys
from contracts.records import OutputRecord
from tests.conftest import entry_record


def test_resp_commands_are_what_redis_py_sends() -> None:
    commands: list[tuple[object, ...]] = [
        ("EVAL", "return 1", 2, "k1", "ké", b"\x00\xff\r\n", 5, 300),
        ("MGET", "a", "b"),
        ("XACK", "s", "g", "1-0"),
    ]
    assert resp_commands(commands) == b"".join(redis.Connection().pack_commands(commands))


def test_a_job_is_in_redis_once_the_next_is_submitted_and_checks_come_a_job_later(
    redis_url: str,
) -> None:
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    r.set(queue_keys.abort_key("gone"), 1)
    r.set(queue_keys.gateway_key("alive-gw"), 1)
    publisher = Publisher(r, check_every_s=0.0)
    first = [OutputRecord("req-a", 0, [7], text="x", offset=0)]
    assert publisher.submit(first, [], ["gone", "kept"], ["alive-gw", "dead-gw"]) is None
    second = [OutputRecord("req-a", 0, [8], text="y", offset=1, final=True)]
    checked = publisher.submit(second, [], [], [])
    assert checked is not None
    assert checked.aborted == {"gone"} and checked.gateways_gone == {"dead-gw"}
    assert publisher.wait() is None  # the second job checked nothing
    assert publisher.idle
    entries = r.xrange(queue_keys.output_key("req-a"))
    assert entries is not None
    assert [entry_record(e).token_ids for e in entries] == [[7], [8]]  # in order, both there
    publisher.close()
