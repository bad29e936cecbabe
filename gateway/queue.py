"""The Redis contract between the gateway and the compute workers. Torch-free.

Every Redis key name lives in this one module, with every function that touches Redis (the
gateway writes requests and reads token deltas; compute workers do the reverse); the records that
travel are defined in ``gateway.records`` and re-exported here. arq is the model:
plain functions over a client; the worker side takes a sync ``redis.Redis``, the gateway side a
``redis.asyncio.Redis``. Both must use ``decode_responses=False`` (the default): records are bytes.

Keys (all under ``pagedserve:``)::

    pagedserve:requests        stream of RequestRecord; consumer group "pagedserve:workers"
    pagedserve:out:{req_id}    stream of OutputRecord (token deltas) for one request
    pagedserve:abort:{req_id}  string "1": the client went away (SET EX ABORT_TTL_S)
    pagedserve:wake:{reader}   stream (MAXLEN ~16, EXPIRE WAKE_TTL_S): wakes a reader's
                               blocked ``read_outputs`` so it adds new requests' streams
    pagedserve:gateway:{id}    string "1" with a TTL: the gateway ``id`` is alive (it renews
                               the key, ``renew_gateway``); workers abort the requests of a
                               gateway whose key is gone (``RequestRecord.gateway``)

An entry's fields: ``v`` (record version, b"1"), ``rec`` (one msgspec Struct as MessagePack) and,
for requests, ``id`` (the req_id in clear, so a malformed record can still be answered).

Lifecycle and cleanup:

- The gateway ``submit``s (XADD). A worker ``read_requests`` (XREADGROUP ``>``): the entry is
  pending for that consumer until ``ack``, which XACKs **and XDELs** it, so the request stream
  only ever holds waiting and in-flight requests. No MAXLEN/XTRIM: trimming by length could drop
  requests nobody has served yet; the gateway applies back-pressure with XLEN instead.
- A worker holds a *lease* on its pending entries: it must ``touch`` them more often than
  ``CLAIM_IDLE_MS`` (e.g. every few seconds); ``touch`` returns the ids it still owns. Entries
  idle longer belong to a dead worker and another one takes them with ``claim_stale``
  (XAUTOCLAIM), reads what was already streamed with ``read_streamed`` and resumes. An entry
  delivered more than ``MAX_DELIVERIES`` times (it kills workers) is answered with an error.
- A worker's step is one round trip: ``step`` publishes all deltas (one EVAL), acks finished
  requests and checks aborts (MGET). Every ``publish`` refreshes the output stream's TTL:
  ``OUTPUT_IDLE_TTL_S`` while running (so a stream of a request nobody finishes still goes
  away), ``OUTPUT_TTL_S`` after its final record.
- Abort keys expire by themselves after ``ABORT_TTL_S``.
- A worker that lost track of its requests (Redis or the kvstore went away) or a restarted one
  under the same consumer name takes its own pending entries back with ``claim_own``.

A gateway reads all its requests' output streams with one blocking ``read_outputs`` (one XREAD
over every stream, one round trip per worker step instead of one per request); ``wake`` makes
that XREAD return at once when a request is added (an entry in the reader's wake stream, so a
wake sent before the XREAD starts is not lost). ``stream_output`` reads one request's stream.

Malformed entries (garbage, another version, an unknown shape) raise ``RecordError`` from the
``decode_*`` functions. The reader loops never crash on them: ``read_requests``/``claim_stale``
skip such an entry, log it, answer its req_id (if readable) with a final "error" record, and ack
it; ``stream_output`` yields a final "error" record and stops; ``read_streamed`` raises
``RecordError`` (the resuming worker cannot continue the request and should fail it).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, NamedTuple

import redis
import redis.asyncio
import redis.client

from gateway.records import (  # the contract's records, re-exported
    _VERSION,
    RECORD_VERSION,
    FinishReason,
    OutputRecord,
    RecordError,
    RequestRecord,
    SamplingParams,
    Streamed,
    StreamedSequence,
    decode_output,
    decode_request,
    encode,
)

__all__ = [
    "RECORD_VERSION",
    "FinishReason",
    "OutputRecord",
    "RecordError",
    "RequestRecord",
    "SamplingParams",
    "Streamed",
    "StreamedSequence",
    "decode_output",
    "decode_request",
    "encode",
]

log = logging.getLogger("pagedserve.queue")


# ---------------------------------------------------------------- key names and limits
KEY_PREFIX = "pagedserve:"
REQUEST_STREAM = KEY_PREFIX + "requests"
REQUEST_GROUP = KEY_PREFIX + "workers"

OUTPUT_TTL_S = 300  # an output stream lives this long after its final record
OUTPUT_IDLE_TTL_S = 3600  # ... and this long after any other record (nobody finished it)
ABORT_TTL_S = 3600  # must outlast the longest wait in the queue
CLAIM_IDLE_MS = 30_000  # a pending request untouched this long belongs to a dead worker
MAX_DELIVERIES = 3  # deliveries (first read + claims) before a request is failed
STREAM_READ_COUNT = 256  # entries per XREAD in stream_output
WAKE_TTL_S = 3600  # a wake stream outlives its reader by at most this
GATEWAY_TTL_S = 30  # a gateway's liveness key lives this long unless renewed


class Checked(NamedTuple):
    """What ``step`` found: requests whose client aborted, gateways no longer alive."""

    aborted: set[str]
    gateways_gone: set[str]


def output_key(req_id: str) -> str:
    return f"{KEY_PREFIX}out:{req_id}"


def abort_key(req_id: str) -> str:
    return f"{KEY_PREFIX}abort:{req_id}"


def wake_key(reader: str) -> str:
    return f"{KEY_PREFIX}wake:{reader}"


def gateway_key(gateway_id: str) -> str:
    return f"{KEY_PREFIX}gateway:{gateway_id}"


_OUTPUT_PREFIX = output_key("")


def _payload(entry_id: Any, fields: dict[bytes, bytes]) -> bytes:
    """The ``rec`` field of an entry whose version this build reads."""
    version = fields.get(b"v")
    if version != _VERSION:
        raise RecordError(f"entry {_s(entry_id)}: record version {version!r}, not {_VERSION!r}")
    if b"rec" not in fields:
        raise RecordError(f"entry {_s(entry_id)}: no 'rec' field")
    return fields[b"rec"]


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _check_bytes(r: redis.Redis | redis.asyncio.Redis) -> None:
    if r.connection_pool.connection_kwargs.get("decode_responses"):
        raise ValueError("gateway.queue needs a Redis client with decode_responses=False")


def _streams(reply: Any) -> list[tuple[Any, list[tuple[Any, Any]]]]:
    """XREAD/XREADGROUP reply as [(key, entries)]: RESP2 gives a list, RESP3 a dict."""
    if not reply:
        return []
    return list(reply.items()) if isinstance(reply, dict) else list(reply)


# ---------------------------------------------------------------- worker side (sync)
def ensure_group(r: redis.Redis) -> None:
    """Creates the request stream and its consumer group (from the start: requests submitted
    before any worker existed are served). Idempotent."""
    _check_bytes(r)
    try:
        r.xgroup_create(REQUEST_STREAM, REQUEST_GROUP, id="0", mkstream=True)
    except redis.ResponseError as err:
        if "BUSYGROUP" not in str(err):
            raise


def read_requests(
    r: redis.Redis, consumer: str, count: int = 16, block_ms: int | None = None
) -> list[tuple[str, RequestRecord]]:
    """New requests for ``consumer`` as ``(entry_id, record)``; ``block_ms=None`` does not wait
    (a busy engine loop). block_ms must stay below the client's socket_timeout (redis-py 8: 5 s
    by default; ``block_ms=0``, forever, needs socket_timeout=None). Check ``aborted`` on them
    before admitting: the client may have left."""
    try:
        reply = r.xreadgroup(REQUEST_GROUP, consumer, {REQUEST_STREAM: ">"}, count, block_ms)
    except redis.ResponseError as err:  # the stream is gone (Redis restarted without AOF)
        if "NOGROUP" not in str(err):
            raise
        ensure_group(r)
        return []
    return _accept(r, [entry for _, entries in _streams(reply) for entry in entries])


def claim_stale(
    r: redis.Redis,
    consumer: str,
    min_idle_ms: int = CLAIM_IDLE_MS,
    count: int = 16,
    max_deliveries: int = MAX_DELIVERIES,
) -> list[tuple[str, RequestRecord]]:
    """Takes over up to ``count`` requests of dead workers (pending and untouched for
    ``min_idle_ms``). Resume each from ``read_streamed``. Requests delivered more than
    ``max_deliveries`` times are failed (error record, ack) instead of returned."""
    entries: list[tuple[Any, Any]] = []
    cursor, vanished = "0-0", False
    while len(entries) < count:
        reply = r.xautoclaim(
            REQUEST_STREAM, REQUEST_GROUP, consumer, min_idle_ms, cursor, count - len(entries)
        )
        # Redis 6.2: [cursor, entries]; Redis 7: [cursor, entries, ids of deleted entries].
        # 6.2 returns an entry deleted from the stream (but still pending) as (None, None).
        cursor, claimed = _s(reply[0]), reply[1]
        vanished |= any(fields is None for _, fields in claimed)
        entries += [(entry_id, fields) for entry_id, fields in claimed if fields is not None]
        if cursor == "0-0":
            break
    if vanished:
        _ack_vanished(r, consumer)
    if not entries:
        return []
    pipe = r.pipeline(transaction=False)
    for entry_id, _ in entries:
        pipe.xpending_range(REQUEST_STREAM, REQUEST_GROUP, entry_id, entry_id, 1)
    deliveries = {p[0]["message_id"]: p[0]["times_delivered"] for p in pipe.execute() if p}
    return _accept(r, entries, deliveries, max_deliveries)


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
    max_deliveries: int = MAX_DELIVERIES,
    limit: int = 10_000,
) -> list[tuple[str, RequestRecord]]:
    """``consumer``'s own pending requests, to serve again: after a restart under the same name
    (``redeliver``: each counts as a delivery, and those delivered more than ``max_deliveries``
    times are failed, as in ``claim_stale``: a request that kills its worker must not kill it
    forever), or after the worker lost track of them while Redis or the kvstore was away (not a
    new delivery). Atomic (one script): an entry another worker claimed meanwhile is not taken
    back, and each one taken has its idle time reset, so no one claims it now. Resume each from
    ``read_streamed``."""
    flag = "1" if redeliver else "0"
    reply = r.eval(_CLAIM_OWN_LUA, 1, REQUEST_STREAM, REQUEST_GROUP, consumer, limit, flag)
    ids, counts = [_s(x) for x in reply[::2]], [int(x) for x in reply[1::2]]
    if not ids:
        return []
    pipe = r.pipeline(transaction=False)
    for entry_id in ids:
        pipe.xrange(REQUEST_STREAM, entry_id, entry_id, 1)
    found = {_s(rows[0][0]): rows[0][1] for rows in pipe.execute() if rows}
    gone = [entry_id for entry_id in ids if entry_id not in found]
    if gone:  # deleted from the stream without an ack: nothing left to serve
        r.xack(REQUEST_STREAM, REQUEST_GROUP, *gone)
    deliveries: dict[Any, int] = dict(zip(ids, counts, strict=True))
    return _accept(r, list(found.items()), deliveries, max_deliveries)


def _accept(
    r: redis.Redis,
    entries: list[tuple[Any, dict[bytes, bytes]]],
    deliveries: dict[Any, int] | None = None,
    max_deliveries: int = MAX_DELIVERIES,
) -> list[tuple[str, RequestRecord]]:
    """Decodes entries; fails (error record + ack) the malformed and the poisonous ones."""
    good: list[tuple[str, RequestRecord]] = []
    failed: list[tuple[str, str | None, str]] = []  # entry id, req_id if known, message
    for raw_id, fields in entries:
        entry_id = _s(raw_id)
        req_id = fields[b"id"].decode(errors="replace") if b"id" in fields else None
        try:
            record = decode_request(_payload(raw_id, fields))
        except RecordError as err:
            failed.append((entry_id, req_id, f"malformed request entry: {err}"))
            continue
        times = (deliveries or {}).get(raw_id, 1)
        if times > max_deliveries:
            message = f"request delivered {times} times (its workers died); giving up"
            failed.append((entry_id, record.req_id, message))
        else:
            good.append((entry_id, record))
    if failed:
        pipe = r.pipeline(transaction=False)
        for entry_id, req_id, message in failed:
            log.warning("request entry %s (req_id %s) failed: %s", entry_id, req_id, message)
            if req_id is not None:
                publish(
                    pipe, [OutputRecord(req_id, finish_reason="error", error=message, final=True)]
                )
        ack(pipe, [entry_id for entry_id, _, _ in failed])
        pipe.execute()
    return good


def _ack_vanished(r: redis.Redis, consumer: str, limit: int = 1000) -> None:
    """Acks ``consumer``'s pending entries that no longer exist in the stream (trimmed or
    deleted without XACK): Redis 6.2 keeps them pending forever otherwise."""
    pending = r.xpending_range(REQUEST_STREAM, REQUEST_GROUP, "-", "+", limit, consumer)
    ids = [p["message_id"] for p in pending]
    pipe = r.pipeline(transaction=False)
    for entry_id in ids:
        pipe.xrange(REQUEST_STREAM, entry_id, entry_id, 1)
    gone = [entry_id for entry_id, found in zip(ids, pipe.execute(), strict=True) if not found]
    if gone:
        log.warning("acking %d pending request entries deleted from the stream", len(gone))
        r.xack(REQUEST_STREAM, REQUEST_GROUP, *gone)


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


def touch(r: redis.Redis, consumer: str, entry_ids: Sequence[str]) -> list[str]:
    """Renews the lease on ``consumer``'s in-flight requests (resets their idle time, atomically,
    only where ``consumer`` still owns them). Returns the ids it still owns; a missing one was
    claimed by another worker, which now serves it: stop working on that request."""
    if not entry_ids:
        return []
    owned = r.eval(_TOUCH_LUA, 1, REQUEST_STREAM, REQUEST_GROUP, consumer, *entry_ids)
    return [_s(entry_id) for entry_id in owned]


def ack(pipe_or_client: redis.Redis, entry_ids: Sequence[str]) -> None:
    """XACK and XDEL finished requests: atomically (MULTI) when given a client, queued into the
    caller's pipeline (its owner executes it) when given one."""
    if not entry_ids:
        return
    own = not isinstance(pipe_or_client, redis.client.Pipeline)
    pipe = pipe_or_client.pipeline(transaction=True) if own else pipe_or_client
    pipe.xack(REQUEST_STREAM, REQUEST_GROUP, *entry_ids)
    pipe.xdel(REQUEST_STREAM, *entry_ids)
    if own:
        pipe.execute()


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
    args: list[bytes | int] = [_VERSION]
    for record in records:
        keys.append(output_key(record.req_id))
        args += [encode(record), OUTPUT_TTL_S if record.final else OUTPUT_IDLE_TTL_S]
    if keys:
        pipe_or_client.eval(_PUBLISH_LUA, len(keys), *keys, *args)


def aborted(r: redis.Redis, req_ids: Sequence[str]) -> set[str]:
    """The subset of ``req_ids`` whose client aborted, in one round trip (MGET)."""
    if not req_ids:
        return set()
    values = r.mget([abort_key(req_id) for req_id in req_ids])
    return {req_id for req_id, v in zip(req_ids, values, strict=True) if v is not None}


def is_aborted(r: redis.Redis, req_id: str) -> bool:
    return bool(r.exists(abort_key(req_id)))


def step(
    r: redis.Redis,
    records: Iterable[OutputRecord],
    ack_ids: Sequence[str] = (),
    check_aborted: Sequence[str] = (),
    check_gateways: Sequence[str] = (),
) -> Checked:
    """One engine step's Redis traffic in one round trip: publish the deltas, ack the finished
    requests (ack after their final record), and find which of ``check_aborted`` were aborted
    and which of ``check_gateways`` are no longer alive. Not atomic: a crash may leave a final
    record unacked; ``read_streamed(...).final`` tells the worker that reclaims it to just ack
    it."""
    pipe = r.pipeline(transaction=False)
    publish(pipe, records)
    ack(pipe, ack_ids)
    keys = [abort_key(i) for i in check_aborted] + [gateway_key(g) for g in check_gateways]
    if keys:
        pipe.mget(keys)
    results = pipe.execute()
    values = results[-1] if keys else []
    aborted = {i for i, v in zip(check_aborted, values, strict=False) if v is not None}
    alive = values[len(check_aborted) :]
    gone = {g for g, v in zip(check_gateways, alive, strict=True) if v is None}
    return Checked(aborted, gone)


def read_streamed(r: redis.Redis, req_id: str) -> Streamed:
    """All tokens a request has streamed so far, per sequence index, to resume it. Raises
    RecordError on a malformed entry (the request cannot be resumed: fail it)."""
    streamed = Streamed(sequences={})
    for entry_id, fields in r.xrange(output_key(req_id)):
        record = decode_output(_payload(entry_id, fields))
        sequence = streamed.sequences.setdefault(record.index, StreamedSequence([]))
        sequence.token_ids.extend(record.token_ids)
        if record.finish_reason is not None:
            sequence.finish_reason = record.finish_reason
        streamed.final = streamed.final or record.final
    return streamed


# ---------------------------------------------------------------- gateway side (async)
async def submit(r: redis.asyncio.Redis, record: RequestRecord) -> str:
    """Queues a request (params validated: ValueError); returns its entry id."""
    _check_bytes(r)
    record.params.validate()
    fields = {"v": _VERSION, "id": record.req_id, "rec": encode(record)}
    return _s(await r.xadd(REQUEST_STREAM, fields))


async def renew_gateway(r: redis.asyncio.Redis, gateway_id: str, ttl_s: float) -> None:
    """Says gateway ``gateway_id`` is alive for ``ttl_s`` more seconds (renew well before)."""
    await r.set(gateway_key(gateway_id), b"1", px=max(int(ttl_s * 1000), 1))


async def drop_gateway(r: redis.asyncio.Redis, gateway_id: str) -> None:
    """The gateway stops: workers abort what is left of its requests at once."""
    await r.delete(gateway_key(gateway_id))


async def missing(r: redis.asyncio.Redis, requests: dict[str, str]) -> set[str]:
    """Of ``requests`` (req_id -> its entry id in the request stream), those Redis no longer
    knows: neither the entry (waiting or being served) nor an output stream (it finished) is
    there, as after a restart that lost them (no persistence, or writes of the last second)."""
    if not requests:
        return set()
    async with r.pipeline(transaction=False) as pipe:
        for req_id, entry_id in requests.items():
            pipe.xrange(REQUEST_STREAM, entry_id, entry_id, 1)
            pipe.exists(output_key(req_id))
        found = await pipe.execute()
    pairs = zip(found[::2], found[1::2], strict=True)
    return {
        req_id for req_id, (entry, out) in zip(requests, pairs, strict=True) if not (entry or out)
    }


async def abort(r: redis.asyncio.Redis, req_id: str) -> None:
    """Tells the worker serving ``req_id`` (or the one that will pick it up) to stop."""
    await r.set(abort_key(req_id), b"1", ex=ABORT_TTL_S)


async def stream_output(
    r: redis.asyncio.Redis, req_id: str, block_ms: int = 1000, after: str = "0-0"
) -> AsyncIterator[OutputRecord]:
    """The request's deltas in order (from the start, or after entry id ``after``), until and
    including its ``final`` record. Waits as long as it takes (each XREAD blocks ``block_ms``):
    bound it with ``asyncio.timeout`` if needed; cancelling it is safe. block_ms must stay below
    the client's socket_timeout (5 s by default in redis-py 8). A malformed entry ends the stream
    with a synthesized final "error" record. Holds one pool connection while waiting.
    """
    _check_bytes(r)
    key, last = output_key(req_id), after
    while True:
        reply = await r.xread({key: last}, count=STREAM_READ_COUNT, block=block_ms)
        for _, entries in _streams(reply):
            for entry_id, fields in entries:
                last = entry_id
                try:
                    record = decode_output(_payload(entry_id, fields))
                except RecordError as err:
                    log.warning("output of %s: %s", req_id, err)
                    yield OutputRecord(req_id, finish_reason="error", error=str(err), final=True)
                    return
                yield record
                if record.final:
                    return


async def wake(r: redis.asyncio.Redis, reader: str) -> None:
    """Makes ``reader``'s ``read_outputs`` return now (or at once, if it has not started)."""
    async with r.pipeline(transaction=False) as pipe:
        pipe.xadd(wake_key(reader), {"v": _VERSION}, maxlen=16, approximate=True)
        pipe.expire(wake_key(reader), WAKE_TTL_S)
        await pipe.execute()


async def read_outputs(
    r: redis.asyncio.Redis,
    cursors: dict[str, str],
    reader: str,
    wake_cursor: str = "0-0",
    block_ms: int = 1000,
) -> tuple[list[tuple[str, str, OutputRecord]], str]:
    """New deltas of many requests in one XREAD: ``cursors`` maps each req_id to the last entry
    id read from its output stream ("0-0": from the start). Blocks up to ``block_ms`` until one
    has an entry or ``reader`` is woken (``wake``; ``wake_cursor`` is the last wake entry seen).
    Returns ``[(req_id, entry_id, record)]`` in stream order per request, and the new wake
    cursor. A malformed entry comes back as a final "error" record (read no further)."""
    _check_bytes(r)
    streams = {output_key(req_id): cursor for req_id, cursor in cursors.items()}
    streams[wake_key(reader)] = wake_cursor
    reply = await r.xread(streams, count=STREAM_READ_COUNT, block=block_ms)
    out: list[tuple[str, str, OutputRecord]] = []
    for key, entries in _streams(reply):
        name = _s(key)
        if name == wake_key(reader):
            wake_cursor = _s(entries[-1][0]) if entries else wake_cursor
            continue
        req_id = name[len(_OUTPUT_PREFIX) :]
        for entry_id, fields in entries:
            try:
                record = decode_output(_payload(entry_id, fields))
            except RecordError as err:
                log.warning("output of %s: %s", req_id, err)
                out.append((req_id, _s(entry_id), _error_record(req_id, str(err))))
                break
            out.append((req_id, _s(entry_id), record))
            if record.final:
                break
    return out, wake_cursor


def _error_record(req_id: str, message: str) -> OutputRecord:
    return OutputRecord(req_id, finish_reason="error", error=message, final=True)
