"""The engine's Redis output path, pipelined across steps: ``Publisher``.

Each engine step hands one job (its deltas, the entries to ack, the requests and gateways to
check, how many new requests it has room for) to ``submit``, which writes the job's commands
(``queue_worker.step_pipeline``, then a non-blocking XREADGROUP) on a connection of its own and
returns without waiting; their replies are read by ``collect``, a step later (before the next
``submit``), by which time Redis has long answered. Jobs therefore reach Redis in order, a step's
records before the next step's, and what a job found (``Replies``: aborted requests, gateways
gone, new requests) reaches the engine one step later. A busy engine thus takes new requests
without a round trip of its own (measured on the H200: 1.6 ms of an 8 ms step waiting for
XREADGROUP's reply, 1000 requests through HTTP); the requests a job read are this worker's
(pending in its consumer group) from then on, and are taken back by ``claim_own`` if the engine
drops them.

No thread: the encoding and the reply parsing are Python, and a thread doing them would hold
the GIL that the engine's loop needs; writing now and reading a step later gives the same overlap
with Redis without that contention. (A first version used a thread; its cost was not measured
apart from the device waits found at the same time, see BENCHMARKS-archive.md.)

Abort and liveness checks (an MGET of one key per request) ride along at most every
``check_every_s``: an abort is seen within that time plus a step.

An error (Redis away, an error reply) drops the connection and is raised by the ``submit`` or
``collect`` that meets it; the job's records may or may not be in Redis (the engine then rebuilds
its requests from what Redis holds, and the gateway skips a record it already has).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis
from redis.connection import Connection

from contracts import queue_keys, queue_worker
from contracts.records import OutputRecord, RequestRecord

__all__ = ["Publisher", "Replies"]

log = logging.getLogger("pagedserve.compute")


@dataclass(frozen=True)
class _Sent:
    """A job written to Redis whose replies are not read yet."""

    replies: int  # of the step pipeline (the XREADGROUP's comes after them)
    check_aborted: Sequence[str]
    check_gateways: Sequence[str]
    read: bool  # an XREADGROUP ends the job


@dataclass(frozen=True)
class Replies:
    """What a job found: the checks' result (None: it checked nothing) and the new requests it
    read (now pending for this worker: start them)."""

    checked: queue_keys.Checked | None = None
    requests: list[tuple[str, RequestRecord]] = field(default_factory=list)


def resp_commands(commands: list[tuple[object, ...]]) -> bytes:
    """The RESP encoding of ``commands`` (arguments str, int or bytes), as redis-py's
    ``pack_commands`` makes it, in one join: that one spends ~1 us of Python per argument, and
    a step's publish has two per record."""
    parts: list[bytes] = []
    for args in commands:
        parts.append(b"*%d\r\n" % len(args))
        for arg in args:
            data = arg if isinstance(arg, bytes) else str(arg).encode()
            parts += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(parts)


class Publisher:
    def __init__(
        self,
        r: redis.Redis,
        consumer: str,
        check_every_s: float = 0.05,
        stream: str = queue_keys.REQUEST_STREAM,
    ) -> None:
        """``consumer``: the worker's name in the requests' consumer group of ``stream``."""
        self._redis = r
        self._consumer = consumer
        self._stream = stream
        self._check_every_s = check_every_s
        self._next_check = 0.0
        self._conn: Connection | None = None
        self._sent: _Sent | None = None

    def submit(
        self,
        records: list[OutputRecord],
        acks: list[str],
        check_aborted: Sequence[str],
        check_gateways: Sequence[str],
        read: int = 0,
    ) -> None:
        """Writes this job (``read``: up to that many new requests); ``collect`` the one
        before first (what it found decides how many to read)."""
        if self._sent is not None:
            raise RuntimeError("a job's replies are unread: collect() first")
        now = time.monotonic()
        if now < self._next_check:
            check_aborted = check_gateways = ()
        else:
            self._next_check = now + self._check_every_s
        watched = queue_worker.watched_keys(check_aborted, check_gateways)
        pipe = queue_worker.step_pipeline(self._redis, records, acks, watched, self._stream)
        commands = [args for args, _options in pipe.command_stack]
        replies = len(commands)
        if read > 0:
            commands.append(queue_worker.read_command(self._consumer, read, self._stream))
        if not commands:
            return
        conn = self._connection()
        try:
            conn.send_packed_command([resp_commands(commands)], check_health=False)
        except BaseException:
            self._drop()
            raise
        self._sent = _Sent(replies, check_aborted, check_gateways, read > 0)

    def collect(self) -> Replies:
        """Reads the replies of the job written last, if any: what it found."""
        sent, self._sent = self._sent, None
        if sent is None or self._conn is None:
            return Replies()
        try:
            replies = [self._conn.read_response() for _ in range(sent.replies)]
            requests = self._read_requests() if sent.read else []
        except BaseException:
            self._drop()
            raise
        checked = None
        if sent.check_aborted or sent.check_gateways:
            checked = queue_worker.checked(replies[-1], sent.check_aborted, sent.check_gateways)
        return Replies(checked, requests)

    def _read_requests(self) -> list[tuple[str, RequestRecord]]:
        """The reply of a job's XREADGROUP: its requests (none when the consumer group is gone,
        a Redis restarted without its data: the group is made again)."""
        assert self._conn is not None
        try:
            reply = self._conn.read_response()
        except redis.ResponseError as err:  # read whole: the connection stays in step
            if "NOGROUP" not in str(err):
                raise
            queue_worker.ensure_group(self._redis, self._stream)
            return []
        return queue_worker.requests_of(self._redis, reply, self._stream)

    def drain(self) -> None:
        """Collects the job written last, if any; its error (Redis away) is logged, not raised:
        the caller rebuilds its state or stops."""
        try:
            self.collect()
        except redis.RedisError as err:
            log.warning("the last records were not published: %s", err)

    @property
    def idle(self) -> bool:
        """No job written whose replies are unread."""
        return self._sent is None

    def close(self) -> None:
        """Gives the connection back (after reading what is owed on it)."""
        try:
            self.collect()
        finally:
            if self._conn is not None:
                self._redis.connection_pool.release(self._conn)
                self._conn = None

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self._redis.connection_pool.get_connection()
        return self._conn

    def _drop(self) -> None:
        """Discards the connection: replies may be left unread on it."""
        self._sent = None
        if self._conn is not None:
            self._conn.disconnect()
            self._redis.connection_pool.release(self._conn)
            self._conn = None
