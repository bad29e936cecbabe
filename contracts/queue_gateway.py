"""The gateway's side of the Redis contract (``contracts.queue_keys`` says what each key holds and
how entries live): queue requests, read every in-flight request's deltas with one XREAD, abort,
renew this gateway's liveness, move the requests of a pool without a worker to another pool's
stream. ``redis.asyncio.Redis`` clients. Torch-free.

A malformed output entry comes back as a final "error" record (``read_outputs``,
``stream_output``): the reader loops never crash on one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import msgspec
import redis.asyncio
from redis.typing import EncodableT, FieldT, KeyT, StreamIdT

from contracts import queue_keys
from contracts.records import (
    OutputRecord,
    RecordError,
    RequestRecord,
    decode_output,
    decode_request,
    encode,
)

log = logging.getLogger("pagedserve.queue")


async def submit(
    r: redis.asyncio.Redis, record: RequestRecord, stream: str = queue_keys.REQUEST_STREAM
) -> str:
    """Queues a request on ``stream`` (its pool's: ``queue_keys.request_stream``; params
    validated: ValueError); returns its entry id."""
    queue_keys.check_bytes(r)
    record.params.validate()
    fields: dict[FieldT, EncodableT] = {
        "v": queue_keys.RECORD_FIELD_VERSION,
        "id": record.req_id,
        "rec": encode(record),
    }
    return queue_keys.text(await r.xadd(stream, fields))


async def renew_gateway(r: redis.asyncio.Redis, gateway_id: str, ttl_s: float) -> None:
    """Says gateway ``gateway_id`` is alive for ``ttl_s`` more seconds (renew well before)."""
    await r.set(queue_keys.gateway_key(gateway_id), b"1", px=max(int(ttl_s * 1000), 1))


async def drop_gateway(r: redis.asyncio.Redis, gateway_id: str) -> None:
    """The gateway stops: workers abort what is left of its requests at once."""
    await r.delete(queue_keys.gateway_key(gateway_id))


async def missing(r: redis.asyncio.Redis, requests: dict[str, tuple[str, str]]) -> set[str]:
    """Of ``requests`` (req_id -> its request stream and entry id there), those Redis no longer
    knows: neither the entry (waiting or being served) nor an output stream (it finished) is
    there, as after a restart that lost them (no persistence, or writes of the last second)."""
    if not requests:
        return set()
    async with r.pipeline(transaction=False) as pipe:
        for req_id, (stream, entry_id) in requests.items():
            pipe.xrange(stream, entry_id, entry_id, 1)
            pipe.exists(queue_keys.output_key(req_id))
        found = await pipe.execute()
    pairs = zip(found[::2], found[1::2], strict=True)
    return {
        req_id for req_id, (entry, out) in zip(requests, pairs, strict=True) if not (entry or out)
    }


async def take_stranded(
    r: redis.asyncio.Redis, stream: str, mover: str, min_idle_ms: int, count: int
) -> list[tuple[str, RequestRecord]]:
    """Up to ``count`` requests of ``stream`` that no live worker holds, now pending for the
    consumer ``mover``: those pending and untouched for ``min_idle_ms`` (their worker died) and
    those no worker read yet. For a pool that has no worker: ``move`` them to one that has.
    Entries this build cannot decode stay (pending for ``mover``; a worker fails them once it
    claims them)."""
    group = queue_keys.REQUEST_GROUP
    try:
        reply = await r.xautoclaim(stream, group, mover, min_idle_ms, "0-0", count)
    except redis.ResponseError as err:
        if "NOGROUP" not in str(err):
            raise
        return []  # no worker ever read this stream: nothing is stranded on it yet
    entries = [(entry_id, fields) for entry_id, fields in reply[1] if fields is not None]
    if len(entries) < count:
        read = await r.xreadgroup(group, mover, {stream: ">"}, count=count - len(entries))
        entries += [entry for _, part in queue_keys.streams(read) for entry in part]
    requests = []
    for raw_id, fields in entries:
        entry_id = queue_keys.text(raw_id)
        if not isinstance(fields, dict):  # RESP3 may give the fields as a flat list
            fields = dict(zip(fields[::2], fields[1::2], strict=True))
        try:
            requests.append((entry_id, decode_request(queue_keys.payload(raw_id, fields))))
        except RecordError as err:
            log.warning("request entry %s of %s not moved: %s", entry_id, stream, err)
    return requests


async def move(
    r: redis.asyncio.Redis, entry_id: str, record: RequestRecord, src: str, dst: str
) -> str:
    """Entry ``entry_id`` of ``src`` (pending for the mover: ``take_stranded``) queued again on
    ``dst``, marked to resume (``RequestRecord.resume``), in one transaction: XADD to ``dst``,
    XACK and XDEL from ``src``. Returns the new entry id."""
    fields: dict[FieldT, EncodableT] = {
        "v": queue_keys.RECORD_FIELD_VERSION,
        "id": record.req_id,
        "rec": encode(msgspec.structs.replace(record, resume=True)),
    }
    async with r.pipeline(transaction=True) as pipe:
        pipe.xadd(dst, fields)
        pipe.xack(src, queue_keys.REQUEST_GROUP, entry_id)
        pipe.xdel(src, entry_id)
        new_id, _, _ = await pipe.execute()
    return queue_keys.text(new_id)


async def abort(r: redis.asyncio.Redis, req_id: str) -> None:
    """Tells the worker serving ``req_id`` (or the one that will pick it up) to stop."""
    await r.set(queue_keys.abort_key(req_id), b"1", ex=queue_keys.ABORT_TTL_S)


async def stream_output(
    r: redis.asyncio.Redis, req_id: str, block_ms: int = 1000, after: str = "0-0"
) -> AsyncIterator[OutputRecord]:
    """The request's deltas in order (from the start, or after entry id ``after``), until and
    including its ``final`` record. Waits as long as it takes (each XREAD blocks ``block_ms``):
    bound it with ``asyncio.timeout`` if needed; cancelling it is safe. block_ms must stay below
    the client's socket_timeout (5 s by default in redis-py 8). A malformed entry ends the stream
    with a synthesized final "error" record. Holds one pool connection while waiting.
    """
    queue_keys.check_bytes(r)
    key, last = queue_keys.output_key(req_id), after
    while True:
        reply = await r.xread({key: last}, count=queue_keys.STREAM_READ_COUNT, block=block_ms)
        for _, entries in queue_keys.streams(reply):
            for entry_id, fields in entries:
                last = entry_id
                try:
                    record = decode_output(queue_keys.payload(entry_id, fields))
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
        pipe.xadd(
            queue_keys.wake_key(reader),
            {"v": queue_keys.RECORD_FIELD_VERSION},
            maxlen=16,
            approximate=True,
        )
        pipe.expire(queue_keys.wake_key(reader), queue_keys.WAKE_TTL_S)
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
    queue_keys.check_bytes(r)
    streams: dict[KeyT, StreamIdT] = {
        queue_keys.output_key(req_id): cursor for req_id, cursor in cursors.items()
    }
    streams[queue_keys.wake_key(reader)] = wake_cursor
    reply = await r.xread(streams, count=queue_keys.STREAM_READ_COUNT, block=block_ms)
    out: list[tuple[str, str, OutputRecord]] = []
    for key, entries in queue_keys.streams(reply):
        name = queue_keys.text(key)
        if name == queue_keys.wake_key(reader):
            wake_cursor = queue_keys.text(entries[-1][0]) if entries else wake_cursor
            continue
        req_id = name[len(queue_keys.OUTPUT_PREFIX) :]
        for entry_id, fields in entries:
            try:
                record = decode_output(queue_keys.payload(entry_id, fields))
            except RecordError as err:
                log.warning("output of %s: %s", req_id, err)
                out.append((req_id, queue_keys.text(entry_id), _error_record(req_id, str(err))))
                break
            out.append((req_id, queue_keys.text(entry_id), record))
            if record.final:
                break
    return out, wake_cursor


def _error_record(req_id: str, message: str) -> OutputRecord:
    return OutputRecord(req_id, finish_reason="error", error=message, final=True)
