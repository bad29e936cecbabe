"""A worker's requests in from Redis, for the engine's loop (``compute.loop.engine``).

``Intake`` starts the requests the worker's last Redis job read, reads new ones itself when the
engine is idle, keeps the worker's claim on its pending requests (``queue_worker.touch``), takes
over those of dead workers (``queue_worker.claim_stale``), and tells which gateways have been gone
long enough for their requests to end. It owns the requests read but not started yet, the lease
clock and the gateways seen missing; the requests it starts belong to ``Requests``. Each engine
session (``compute.loop.session``) has its own, with its ``Requests``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from compute.batch.admission import ModelLimits, check_request
from compute.batch.registry import Requests
from compute.faults import Faults
from contracts import queue_keys, queue_worker
from contracts.records import ErrorCode, OutputRecord, RecordError, RequestRecord, Streamed

__all__ = ["GATEWAY_MISSING_S", "Intake"]

log = logging.getLogger("pagedserve.compute")
# A gateway's liveness key missing this long (after its TTL, queue_keys.GATEWAY_TTL_S): the
# gateway is gone. A live gateway whose key a Redis restart lost sets it again within a third of
# its TTL (at once when it sees Redis back); this worker's clock starts when it reconnected.
GATEWAY_MISSING_S = 3.0


class Intake:
    """Requests in for worker ``worker_id``. ``free_later`` frees the kvstore's sequences of a
    request another worker took over (``ModelStep.free_later``). A request is started (or taken
    over) inside its fault boundary (``compute.faults``): one that is refused there (``limits``,
    ``compute.batch.admission``) or fails is answered with an error record and acked, and never
    becomes active."""

    def __init__(
        self,
        r: redis.Redis,
        worker_id: str,
        claim_idle_ms: int,
        requests: Requests,
        free_later: Callable[[list[str]], None],
        faults: Faults,
        limits: ModelLimits,
        stream: str = queue_keys.REQUEST_STREAM,
    ) -> None:
        """``stream``: the request stream of the worker's pool."""
        self.redis, self.worker_id, self.claim_idle_ms = r, worker_id, claim_idle_ms
        self.stream = stream
        self.requests = requests
        self.free_later = free_later
        self.faults = faults
        self.limits = limits
        self.incoming: list[tuple[str, RequestRecord]] = []  # read by the last Redis job
        self._next_lease_check = 0.0
        # the entries this worker renewed or started in the last two renewal periods: one of
        # them that ended since may still be pending (its ack goes out with a later Redis job)
        self._recent: list[set[str]] = [set(), set()]
        self._missing_since: dict[str, float] = {}  # gateway -> when its key was first missed

    def take(self, room: int, accepting: bool, idle: bool, block_ms: int | None) -> None:
        """Starts the requests the last Redis job read and takes over those of dead workers
        (while ``room`` lasts and ``accepting``); when ``idle`` it reads new ones itself,
        waiting up to ``block_ms`` for them (no Redis job reads for an idle engine)."""
        if time.monotonic() >= self._next_lease_check:
            self._next_lease_check = time.monotonic() + self.claim_idle_ms / 4000
            self.renew_leases()
            if room > 0 and accepting:
                # XAUTOCLAIM takes this worker's own idle entries too (a step longer than the
                # lease; a request ended whose ack is on its way): those are not taken over
                mine = self.held().union(*self._recent)
                for entry_id, record in queue_worker.claim_stale(
                    self.redis, self.worker_id, self.claim_idle_ms, room, stream=self.stream
                ):
                    if entry_id not in mine:
                        room -= self.take_over(entry_id, record)
        taken, self.incoming = self.incoming, []  # pending for this worker: start them
        if idle and room > 0 and accepting:
            taken += queue_worker.read_requests(
                self.redis, self.worker_id, room, block_ms, self.stream
            )
        for entry_id, record in taken:
            self._recent[-1].add(entry_id)
            if record.resume:  # moved from a pool without a worker: on from what it streamed
                room -= self.take_over(entry_id, record)
            else:
                self._enter(entry_id, record, None)

    def found(self, requests: list[tuple[str, RequestRecord]]) -> None:
        """Requests a Redis job read for this worker (now pending for it): started by the next
        ``take``."""
        self.incoming += requests

    def held(self) -> set[str]:
        """The entries this worker holds: its requests' and those read but not started."""
        return {a.entry_id for a in self.requests.active.values()} | {
            entry_id for entry_id, _ in self.incoming
        }

    def renew_leases(self) -> None:
        """Keeps other workers from taking over this one's requests, started or not
        (``queue_worker.touch``); drops those another worker took over meanwhile."""
        entries = {a.entry_id: a for a in self.requests.active.values()}
        owned = set(queue_worker.touch(self.redis, self.worker_id, list(self.held()), self.stream))
        self._recent = [self._recent[-1], owned]
        self.incoming = [(entry_id, r) for entry_id, r in self.incoming if entry_id in owned]
        for entry_id in set(entries) - owned:
            log.warning(
                "request %s was taken over by another worker", entries[entry_id].record.req_id
            )
            self.free_later(self.requests.remove(entries[entry_id]))

    def take_over(self, entry_id: str, record: RequestRecord) -> int:
        """A request whose worker died (or this one before it lost track of it): continue it
        from the tokens it already streamed, on the kvstore's blocks if they are still there
        (``adopt``). Returns 1 if it became active."""
        try:
            streamed = queue_worker.read_streamed(self.redis, record.req_id)
        except RecordError as err:  # its output is unreadable: it cannot go on
            self.refuse(entry_id, record, str(err), "worker_error")
            return 0
        if streamed.final:  # it finished; only the ack was lost
            queue_worker.ack(self.redis, [entry_id], self.stream)
            return 0
        if record.req_id in self.requests.active:  # this worker's own: its claim had lapsed
            return 0
        self._recent[-1].add(entry_id)
        counts = {i: len(seq.token_ids) for i, seq in streamed.sequences.items()}
        log.info("taking over %s after %s streamed tokens per branch", record.req_id, counts)
        return self._enter(entry_id, record, streamed)

    def _enter(self, entry_id: str, record: RequestRecord, streamed: Streamed | None) -> int:
        """Starts the request (resumes it from ``streamed``, if given) inside its fault
        boundary; refuses it if that fails. Returns 1 if it became active."""
        stage = "admission" if streamed is None else "adoption"
        with self.faults.guard(record.req_id, stage):
            check_request(record, self.limits)
            if streamed is None:
                self.requests.start(entry_id, record)
            else:
                self.requests.resume_streamed(entry_id, record, streamed)
        fault = self.faults.pop(record.req_id)
        if fault is None:
            return 1
        self.refuse(entry_id, record, fault.message, fault.code)
        return 0

    def refuse(
        self,
        entry_id: str,
        record: RequestRecord,
        error: str,
        code: ErrorCode = "invalid_request",
    ) -> None:
        """Fails a request that never became active: its error record, its entry acked."""
        log.error("request %s failed: %s", record.req_id, error)
        failed = OutputRecord(
            record.req_id, finish_reason="error", error=error, final=True, error_code=code
        )
        queue_worker.step(self.redis, [failed], [entry_id], stream=self.stream)

    def gone(self, missing: set[str], now: float | None = None) -> list[str]:
        """The gateways among ``missing`` (whose liveness key a Redis job found missing) that
        have been missing for ``GATEWAY_MISSING_S``, each returned once. Not at the first miss:
        a Redis restart may have lost the key of a live gateway, which sets it again as soon as
        it sees Redis back; a gateway not in ``missing`` is forgotten."""
        now = time.monotonic() if now is None else now
        for gateway in set(self._missing_since) - missing:
            del self._missing_since[gateway]
        gone = []
        for gateway in sorted(missing):
            if now - self._missing_since.setdefault(gateway, now) >= GATEWAY_MISSING_S:
                del self._missing_since[gateway]
                gone.append(gateway)
        return gone
