"""The workers' side of the Redis contract (``contracts.queue_keys`` says what each key holds and
how entries live): take requests, renew their leases, take over those of dead workers, publish
deltas, ack. Sync ``redis.Redis`` clients. Torch-free.

Malformed entries never crash the readers: ``read_requests``/``claim_stale``/``claim_own`` skip
such an entry, log it, answer its req_id (if readable) with a final "error" record, and ack it;
``read_streamed`` raises ``RecordError`` (the resuming worker cannot continue the request and
should fail it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, cast

import redis
import redis.client

from contracts import queue_keys
from contracts.records import (
    ErrorCode,
    OutputRecord,
    RecordError,
    RequestRecord,
    Streamed,
    StreamedSequence,
    decode_output,
    decode_request,
    encode,
)

log = logging.getLogger("pagedserve.queue")
Entries = list[tuple[bytes, dict[bytes, bytes]]]  # XRANGE's reply with decode_responses=False


def ensure_group(r: redis.Redis, stream: str = queue_keys.REQUEST_STREAM) -> None:
    """Creates the request stream and its consumer group (from the start: requests submitted
    before any worker existed are served). Idempotent."""
    queue_keys.check_bytes(r)
    try:
        r.xgroup_create(stream, queue_keys.REQUEST_GROUP, id="0", mkstream=True)
    except redis.ResponseError as err:
        if "BUSYGROUP" not in str(err):
            raise


def read_requests(
    r: redis.Redis,
    consumer: str,
    count: int = 16,
    block_ms: int | None = None,
    stream: str = queue_keys.REQUEST_STREAM,
) -> list[tuple[str, RequestRecord]]:
    """New requests for ``consumer`` as ``(entry_id, record)``; ``block_ms=None`` does not wait
    (a busy engine loop). block_ms must stay below the client's socket_timeout (redis-py 8: 5 s
    by default; ``block_ms=0``, forever, needs socket_timeout=None). Check ``aborted`` on them
    before admitting: the client may have left."""
    try:
        reply = r.xreadgroup(queue_keys.REQUEST_GROUP, consumer, {stream: ">"}, count, block_ms)
    except redis.ResponseError as err:  # the stream is gone (Redis restarted without AOF)
        if "NOGROUP" not in str(err):
            raise
        ensure_group(r, stream)
        return []
    entries = [entry for _, entries in queue_keys.streams(reply) for entry in entries]
    return _accept(r, entries, stream=stream)


def read_command(
    consumer: str, count: int, stream: str = queue_keys.REQUEST_STREAM
) -> tuple[object, ...]:
    """The XREADGROUP of ``read_requests`` (``count`` new entries, no wait) as command arguments,
    for a caller that pipelines it and hands the raw reply to ``requests_of``."""
    group = queue_keys.REQUEST_GROUP
    return ("XREADGROUP", "GROUP", group, consumer, "COUNT", count, "STREAMS", stream, ">")


def requests_of(
    r: redis.Redis, reply: Any, stream: str = queue_keys.REQUEST_STREAM
) -> list[tuple[str, RequestRecord]]:
    """The requests of a raw ``read_command`` reply (RESP2 or RESP3, fields as a flat list), as
    ``read_requests`` returns them (malformed entries failed through ``r``)."""
    entries = [
        (entry_id, dict(zip(fields[::2], fields[1::2], strict=True)))
        for _, stream_entries in queue_keys.streams(reply)
        for entry_id, fields in stream_entries
    ]
    return _accept(r, entries, stream=stream)


def claim_stale(
    r: redis.Redis,
    consumer: str,
    min_idle_ms: int = queue_keys.CLAIM_IDLE_MS,
    count: int = 16,
    max_deliveries: int = queue_keys.MAX_DELIVERIES,
    stream: str = queue_keys.REQUEST_STREAM,
) -> list[tuple[str, RequestRecord]]:
    """Takes over up to ``count`` requests of dead workers (pending and untouched for
    ``min_idle_ms``). Resume each from ``read_streamed``. Requests delivered more than
    ``max_deliveries`` times are failed (error record, ack) instead of returned."""
    entries: list[tuple[Any, Any]] = []
    cursor, vanished = "0-0", False
    while len(entries) < count:
        reply = r.xautoclaim(
            stream,
            queue_keys.REQUEST_GROUP,
            consumer,
            min_idle_ms,
            cursor,
            count - len(entries),
        )
        # Redis 6.2: [cursor, entries]; Redis 7: [cursor, entries, ids of deleted entries].
        # 6.2 returns an entry deleted from the stream (but still pending) as (None, None).
        cursor, claimed = queue_keys.text(reply[0]), reply[1]
        vanished |= any(fields is None for _, fields in claimed)
        entries += [(entry_id, fields) for entry_id, fields in claimed if fields is not None]
        if cursor == "0-0":
            break
    if vanished:
        _ack_vanished(r, consumer, stream=stream)
    if not entries:
        return []
    pipe = r.pipeline(transaction=False)
    for entry_id, _ in entries:
        pipe.xpending_range(stream, queue_keys.REQUEST_GROUP, entry_id, entry_id, 1)
    deliveries = {p[0]["message_id"]: p[0]["times_delivered"] for p in pipe.execute() if p}
    return _accept(r, entries, deliveries, max_deliveries, stream)


_CLAIM_OWN_LUA = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', tonumber(ARGV[3]), ARGV[2])
local out = {}
for _, p in ipairs(pending) do
  if ARGV[4] == '1' then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, p[1])
    out[#out + 1] = p[1]
    out[#out + 1] = p[4] + 1
  else
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, p[1], 'JUSTID')
    out[#out + 1] = p[1]
    out[#out + 1] = p[4]
  end
end
return out
"""


def claim_own(
    r: redis.Redis,
    consumer: str,
    redeliver: bool,
    max_deliveries: int = queue_keys.MAX_DELIVERIES,
    limit: int = 10_000,
    stream: str = queue_keys.REQUEST_STREAM,
) -> list[tuple[str, RequestRecord]]:
    """``consumer``'s own pending requests, to serve again: after a restart under the same name
    (``redeliver``: each counts as a delivery, and those delivered more than ``max_deliveries``
    times are failed, as in ``claim_stale``: a request that kills its worker must not kill it
    forever), or after the worker lost track of them while Redis or the kvstore was away (not a
    new delivery). Atomic (one script): an entry another worker claimed meanwhile is not taken
    back, and each one taken has its idle time reset, so no one claims it now. Resume each from
    ``read_streamed``."""
    flag = "1" if redeliver else "0"
    reply = r.eval(
        _CLAIM_OWN_LUA,
        1,
        stream,
        queue_keys.REQUEST_GROUP,
        consumer,
        limit,
        flag,
    )
    ids, counts = [queue_keys.text(x) for x in reply[::2]], [int(x) for x in reply[1::2]]
    if not ids:
        return []
    pipe = r.pipeline(transaction=False)
    for entry_id in ids:
        pipe.xrange(stream, entry_id, entry_id, 1)
    found = {queue_keys.text(rows[0][0]): rows[0][1] for rows in pipe.execute() if rows}
    gone = [entry_id for entry_id in ids if entry_id not in found]
    if gone:  # deleted from the stream without an ack: nothing left to serve
        r.xack(stream, queue_keys.REQUEST_GROUP, *gone)
    deliveries: dict[Any, int] = dict(zip(ids, counts, strict=True))
    return _accept(r, list(found.items()), deliveries, max_deliveries, stream)


def _accept(
    r: redis.Redis,
    entries: list[tuple[Any, dict[bytes, bytes]]],
    deliveries: dict[Any, int] | None = None,
    max_deliveries: int = queue_keys.MAX_DELIVERIES,
    stream: str = queue_keys.REQUEST_STREAM,
) -> list[tuple[str, RequestRecord]]:
    """Decodes entries; fails (error record + ack) the malformed and the poisonous ones."""
    good: list[tuple[str, RequestRecord]] = []
    failed: list[tuple[str, str | None, str, ErrorCode]] = []  # entry, req_id if known, why
    for raw_id, fields in entries:
        entry_id = queue_keys.text(raw_id)
        req_id = fields[b"id"].decode(errors="replace") if b"id" in fields else None
        try:
            record = decode_request(queue_keys.payload(raw_id, fields))
        except RecordError as err:
            failed.append((entry_id, req_id, f"malformed request entry: {err}", "invalid_request"))
            continue
        times = (deliveries or {}).get(raw_id, 1)
        if times > max_deliveries:
            message = (
                f"its workers died while serving it, {times - 1} times: "
                "not retried (it may be what kills them)"
            )
            failed.append((entry_id, record.req_id, message, "worker_error"))
        else:
            good.append((entry_id, record))
    if failed:
        pipe = r.pipeline(transaction=False)
        for entry_id, req_id, message, code in failed:
            log.warning("request entry %s (req_id %s) failed: %s", entry_id, req_id, message)
            if req_id is not None:
                error = OutputRecord(
                    req_id, finish_reason="error", error=message, final=True, error_code=code
                )
                publish(pipe, [error])
        ack(pipe, [entry_id for entry_id, _, _, _ in failed], stream)
        pipe.execute()
    return good


def _ack_vanished(
    r: redis.Redis, consumer: str, limit: int = 1000, stream: str = queue_keys.REQUEST_STREAM
) -> None:
    """Acks ``consumer``'s pending entries that no longer exist in the stream (trimmed or
    deleted without XACK): Redis 6.2 keeps them pending forever otherwise."""
    pending = r.xpending_range(stream, queue_keys.REQUEST_GROUP, "-", "+", limit, consumer)
    ids = [p["message_id"] for p in pending]
    pipe = r.pipeline(transaction=False)
    for entry_id in ids:
        pipe.xrange(stream, entry_id, entry_id, 1)
    gone = [entry_id for entry_id, found in zip(ids, pipe.execute(), strict=True) if not found]
    if gone:
        log.warning("acking %d pending request entries deleted from the stream", len(gone))
        r.xack(stream, queue_keys.REQUEST_GROUP, *gone)


_TOUCH_LUA = """
local owned = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    owned[#owned + 1] = ARGV[i]
  end
end
return owned
"""


def touch(
    r: redis.Redis, consumer: str, entry_ids: Sequence[str], stream: str = queue_keys.REQUEST_STREAM
) -> list[str]:
    """Renews the lease on ``consumer``'s in-flight requests (resets their idle time, atomically,
    only where ``consumer`` still owns them). Returns the ids it still owns; a missing one was
    claimed by another worker, which now serves it: stop working on that request."""
    if not entry_ids:
        return []
    owned = r.eval(_TOUCH_LUA, 1, stream, queue_keys.REQUEST_GROUP, consumer, *entry_ids)
    return [queue_keys.text(entry_id) for entry_id in owned]


def ack(
    pipe_or_client: redis.Redis | redis.client.Pipeline,
    entry_ids: Sequence[str],
    stream: str = queue_keys.REQUEST_STREAM,
) -> None:
    """XACK and XDEL finished requests: atomically (MULTI) when given a client, queued into the
    caller's pipeline (its owner executes it) when given one."""
    if not entry_ids:
        return
    if isinstance(pipe_or_client, redis.client.Pipeline):
        _ack_into(pipe_or_client, entry_ids, stream)
        return
    pipe = pipe_or_client.pipeline(transaction=True)
    _ack_into(pipe, entry_ids, stream)
    pipe.execute()


def _ack_into(pipe: redis.client.Pipeline, entry_ids: Sequence[str], stream: str) -> None:
    pipe.xack(stream, queue_keys.REQUEST_GROUP, *entry_ids)
    pipe.xdel(stream, *entry_ids)


_PUBLISH_LUA = """
for i = 1, #KEYS do
  redis.call('XADD', KEYS[i], '*', 'v', ARGV[1], 'rec', ARGV[2 * i])
  redis.call('EXPIRE', KEYS[i], ARGV[2 * i + 1])
end
return #KEYS
"""


def publish(pipe_or_client: redis.Redis, records: Iterable[OutputRecord]) -> None:
    """Appends deltas to their output streams and refreshes the streams' TTLs, in one command
    (queued into the caller's pipeline, if given one). One EVAL instead of 2 commands per record:
    redis-py spends ~15 us of Python per pipelined command, 4x the whole EVAL for 256 records.
    EVAL (not EVALSHA) so it needs no SCRIPT LOAD and survives a Redis restart."""
    keys: list[str] = []
    args: list[bytes | int] = [queue_keys.RECORD_FIELD_VERSION]
    for record in records:
        keys.append(queue_keys.output_key(record.req_id))
        args += [
            encode(record),
            queue_keys.OUTPUT_TTL_S if record.final else queue_keys.OUTPUT_IDLE_TTL_S,
        ]
    if keys:
        pipe_or_client.eval(_PUBLISH_LUA, len(keys), *keys, *args)


def step_pipeline(
    r: redis.Redis,
    records: Iterable[OutputRecord],
    ack_ids: Sequence[str] = (),
    watched: Sequence[str] = (),
    stream: str = queue_keys.REQUEST_STREAM,
) -> redis.client.Pipeline:
    """One engine step's Redis traffic, queued (not executed) in a pipeline: publish the deltas,
    ack the finished requests (after their final record), read the ``watched`` keys (MGET,
    last)."""
    pipe = r.pipeline(transaction=False)
    publish(pipe, records)
    ack(pipe, ack_ids, stream)
    if watched:
        pipe.mget(watched)
    return pipe


def watched_keys(check_aborted: Sequence[str], check_gateways: Sequence[str]) -> list[str]:
    """The keys whose presence says a request was aborted or a gateway is alive."""
    watched = [queue_keys.abort_key(i) for i in check_aborted]
    return watched + [queue_keys.gateway_key(g) for g in check_gateways]


def checked(
    values: Sequence[object], check_aborted: Sequence[str], check_gateways: Sequence[str]
) -> queue_keys.Checked:
    """What the MGET of ``watched_keys`` found: the aborted requests, the gateways gone."""
    aborted = {i for i, v in zip(check_aborted, values, strict=False) if v is not None}
    alive = values[len(check_aborted) :]
    gone = {g for g, v in zip(check_gateways, alive, strict=True) if v is None}
    return queue_keys.Checked(aborted, gone)


def step(
    r: redis.Redis,
    records: Iterable[OutputRecord],
    ack_ids: Sequence[str] = (),
    check_aborted: Sequence[str] = (),
    check_gateways: Sequence[str] = (),
    stream: str = queue_keys.REQUEST_STREAM,
) -> queue_keys.Checked:
    """One engine step's Redis traffic in one round trip (``step_pipeline``), and which of
    ``check_aborted`` were aborted and which of ``check_gateways`` are no longer alive. Not
    atomic: a crash may leave a final record unacked; ``read_streamed(...).final`` tells the
    worker that reclaims it to just ack it."""
    watched = watched_keys(check_aborted, check_gateways)
    results = step_pipeline(r, records, ack_ids, watched, stream).execute()
    return checked(results[-1] if watched else [], check_aborted, check_gateways)


def read_streamed(r: redis.Redis, req_id: str) -> Streamed:
    """All tokens a request has streamed so far, per sequence index, to resume it. Raises
    RecordError on a malformed entry (the request cannot be resumed: fail it)."""
    streamed = Streamed(sequences={})
    entries = cast(Entries, r.xrange(queue_keys.output_key(req_id)))
    for entry_id, fields in entries:
        record = decode_output(queue_keys.payload(entry_id, fields))
        sequence = streamed.sequences.setdefault(record.index, StreamedSequence([]))
        sequence.token_ids.extend(record.token_ids)
        if record.finish_reason is not None:
            sequence.finish_reason = record.finish_reason
        streamed.final = streamed.final or record.final
    return streamed
