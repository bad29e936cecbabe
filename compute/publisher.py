"""The engine's Redis output path, pipelined across steps: ``Publisher``.

Each engine step hands one job (its deltas, the entries to ack, the requests and gateways to
check) to ``submit``, which writes the job's commands (``queue_worker.step_pipeline``) on a
connection of its own and returns without waiting; their replies are read by the next ``submit``
(or ``wait``), one step later, by which time Redis has long answered. Jobs therefore reach Redis
in order, a step's records before the next step's, and the ``Checked`` of a job (aborted
requests, gateways gone) reaches the engine one step later.

No thread: the encoding and the reply parsing are Python, and a thread doing them would hold
the GIL that the engine's loop needs; writing now and reading a step later gives the same overlap
with Redis without that contention. (A first version used a thread; its cost was not measured
apart from the device waits found at the same time, see BENCHMARKS.md.)

Abort and liveness checks (an MGET of one key per request) ride along at most every
``check_every_s``: an abort is seen within that time plus a step.

An error (Redis away, an error reply) drops the connection and is raised by the ``submit`` or
``wait`` that meets it; the job's records may or may not be in Redis (the engine then rebuilds
its requests from what Redis holds, and the gateway skips a record it already has).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from redis.connection import Connection

from contracts import queue_keys, queue_worker
from contracts.records import OutputRecord

__all__ = ["Publisher"]


@dataclass(frozen=True)
class _Sent:
    """A job written to Redis whose replies are not read yet."""

    replies: int
    check_aborted: Sequence[str]
    check_gateways: Sequence[str]


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
    def __init__(self, r: redis.Redis, check_every_s: float = 0.05) -> None:
        self._redis = r
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
    ) -> queue_keys.Checked | None:
        """Reads the previous job's replies, writes this job; returns what the previous job's
        checks found (None: it checked nothing), or raises its error."""
        checked = self.wait()
        now = time.monotonic()
        if now < self._next_check:
            check_aborted = check_gateways = ()
        else:
            self._next_check = now + self._check_every_s
        watched = queue_worker.watched_keys(check_aborted, check_gateways)
        pipe = queue_worker.step_pipeline(self._redis, records, acks, watched)
        commands = [args for args, _options in pipe.command_stack]
        if not commands:
            return checked
        conn = self._connection()
        try:
            conn.send_packed_command([resp_commands(commands)], check_health=False)
        except BaseException:
            self._drop()
            raise
        self._sent = _Sent(len(commands), check_aborted, check_gateways)
        return checked

    def wait(self) -> queue_keys.Checked | None:
        """Reads the replies of the job written last, if any; what its checks found (None: it
        checked nothing)."""
        sent, self._sent = self._sent, None
        if sent is None or self._conn is None:
            return None
        try:
            replies = [self._conn.read_response() for _ in range(sent.replies)]
        except BaseException:
            self._drop()
            raise
        if not sent.check_aborted and not sent.check_gateways:
            return None
        return queue_worker.checked(replies[-1], sent.check_aborted, sent.check_gateways)

    @property
    def idle(self) -> bool:
        """No job written whose replies are unread."""
        return self._sent is None

    def close(self) -> None:
        """Gives the connection back (after reading what is owed on it)."""
        try:
            self.wait()
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
