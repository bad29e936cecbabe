"""The Redis contract between the gateway and the compute workers: every key name and limit.
Torch-free.

Every Redis key name lives in this one module; the functions that touch Redis are in
``contracts.queue_worker`` (the workers' side: a sync ``redis.Redis``) and
``contracts.queue_gateway`` (the gateway's side: a ``redis.asyncio.Redis``), the records that
travel in ``contracts.records``. arq is the model: plain functions over a client. Both sides must
use ``decode_responses=False`` (the default): records are bytes.

Keys (all under ``pagedserve:``)::

    pagedserve:requests        stream of RequestRecord; consumer group "pagedserve:workers"
                               (pool 0's: each pool of a host has its own, ``request_stream``)
    pagedserve:requests:{pool} pool ``pool``'s stream (pool > 0), the same group
    pagedserve:requests:{node}:{pool}
                               pool ``pool``'s stream on host ``node`` (several hosts on one
                               Redis: a gateway's ``--nodes``, a worker's ``--node``)
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
- A worker's step is one round trip: ``queue_worker.step`` publishes all deltas (one EVAL), acks
  finished requests and checks aborts and gateways (MGET). Every ``publish`` refreshes the output
  stream's TTL: ``OUTPUT_IDLE_TTL_S`` while running (so a stream of a request nobody finishes still
  goes away), ``OUTPUT_TTL_S`` after its final record.
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

import re
from typing import Any, NamedTuple

import redis
import redis.asyncio

from contracts.records import RECORD_VERSION, RecordError

RECORD_FIELD_VERSION = str(RECORD_VERSION).encode()  # an entry's ``v`` field
KEY_PREFIX = "pagedserve:"
REQUEST_STREAM = KEY_PREFIX + "requests"
REQUEST_GROUP = KEY_PREFIX + "workers"
NODE_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")  # a host's name in its streams' keys

OUTPUT_TTL_S = 300  # an output stream lives this long after its final record
OUTPUT_IDLE_TTL_S = 3600  # ... and this long after any other record (nobody finished it)
ABORT_TTL_S = 3600  # must outlast the longest wait in the queue
CLAIM_IDLE_MS = 30_000  # a pending request untouched this long belongs to a dead worker
# deliveries (first read + claims) of a request: one whose worker died twice, in the middle of
# it each time, is not handed to a third one (it is likely what kills them) but failed
MAX_DELIVERIES = 2
STREAM_READ_COUNT = 256  # entries per XREAD in stream_output
WAKE_TTL_S = 3600  # a wake stream outlives its reader by at most this
# A gateway's liveness key lives this long unless renewed; gateways renew it every third of it,
# so a live one may miss two renewals. Workers end a gateway's requests once its key has been
# missing for compute.loop.intake.GATEWAY_MISSING_S more (a Redis restart may lose a live one's
# key).
GATEWAY_TTL_S = 6.0


class Checked(NamedTuple):
    """What ``step`` found: requests whose client aborted, gateways no longer alive."""

    aborted: set[str]
    gateways_gone: set[str]


def request_stream(pool: int, node: str = "") -> str:
    """The request stream of pool ``pool`` of host ``node`` (its workers read it; the gateway
    adds a request to the stream of the pool the kvstore routed it to). The first host's
    (``node`` empty) pool 0 has the one-GPU stack's ``pagedserve:requests``, so a stack keeps
    its queue when it grows more GPUs; its other pools ``pagedserve:requests:{pool}``; another
    host's pools ``pagedserve:requests:{node}:{pool}`` (``node``: see ``check_node``)."""
    if node:
        return f"{REQUEST_STREAM}:{check_node(node)}:{pool}"
    return REQUEST_STREAM if pool == 0 else f"{REQUEST_STREAM}:{pool}"


def check_node(node: str) -> str:
    """``node`` if it names a host: a lowercase letter, then up to 31 lowercase letters,
    digits, ``-`` or ``_`` (never a number: pools are); else ValueError."""
    if not NODE_NAME.fullmatch(node):
        raise ValueError(
            f"node name {node!r}: a lowercase letter, then up to 31 of a-z, 0-9, '-', '_'"
        )
    return node


def output_key(req_id: str) -> str:
    return f"{KEY_PREFIX}out:{req_id}"


def abort_key(req_id: str) -> str:
    return f"{KEY_PREFIX}abort:{req_id}"


def wake_key(reader: str) -> str:
    return f"{KEY_PREFIX}wake:{reader}"


def gateway_key(gateway_id: str) -> str:
    return f"{KEY_PREFIX}gateway:{gateway_id}"


OUTPUT_PREFIX = output_key("")


def payload(entry_id: Any, fields: dict[bytes, bytes]) -> bytes:
    """The ``rec`` field of an entry whose version this build reads."""
    version = fields.get(b"v")
    if version != RECORD_FIELD_VERSION:
        raise RecordError(
            f"entry {text(entry_id)}: record version {version!r}, not {RECORD_FIELD_VERSION!r}"
        )
    if b"rec" not in fields:
        raise RecordError(f"entry {text(entry_id)}: no 'rec' field")
    return fields[b"rec"]


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def check_bytes(r: redis.Redis | redis.asyncio.Redis) -> None:
    if r.connection_pool.connection_kwargs.get("decode_responses"):
        raise ValueError("the Redis contract needs a client with decode_responses=False")


def streams(reply: Any) -> list[tuple[Any, list[tuple[Any, Any]]]]:
    """XREAD/XREADGROUP reply as [(key, entries)]: RESP2 gives a list, RESP3 a dict."""
    if not reply:
        return []
    return list(reply.items()) if isinstance(reply, dict) else list(reply)
