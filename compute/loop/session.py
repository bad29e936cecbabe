"""What a compute worker rebuilds whenever it (re)connects to the kvstore and Redis: a
``Session``.

A session holds the state of one connection's life: the scheduler, the requests
(``compute.batch.registry``), the kvstore bookkeeping (``compute.loop.kvsync``), the launched steps
(``compute.loop.model_step``), the requests coming in (``compute.loop.intake``), the per-request
faults and the records of the requests it ended, not published yet. Nothing of it outlives the
connection: after losing the kvstore or Redis (or finding the kvstore's state differs from its own)
the engine drops the session (``drop``) and opens a new one, which rebuilds the requests from Redis
(``compute.loop.engine``). What lives as long as the process (the model, the runner over the
kvstore's pool, the publisher, the timeline) is the engine's.

The worker holds nothing that cannot be rebuilt: request state is in Redis (the request entry,
its output stream) and the KV blocks are the kvstore's. A live worker renews its claim on its
requests (``queue_worker.touch``); the requests of a dead one are taken over
(``queue_worker.claim_stale``), rebuilt from the tokens already streamed and ``adopt``ed at the
kvstore, which keeps their blocks for a grace period, so nothing is prefilled again (if the
blocks are gone, it recomputes). The same path serves this worker itself: at startup it takes
back what a previous process under its id left pending (``queue_worker.claim_own``), and when it
loses the kvstore or Redis (a timeout, a restart, a connection error) or finds the kvstore's
state differs from its own, it drops its session, registers again (mapping the
kvstore's new pool if it restarted), and rebuilds its requests from Redis, retrying with backoff
until both answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence

import redis

from compute.batch.admission import ModelLimits
from compute.batch.registry import Requests
from compute.batch.requests import Active
from compute.batch.scheduler import Scheduler, SchedulerConfig
from compute.faults import Faults
from compute.loop.intake import Intake
from compute.loop.kvsync import KVSync, Refusal
from compute.loop.model_step import ModelStep
from compute.model.runner import ModelRunner
from compute.sampling.grammar import Grammars
from contracts import queue_keys, queue_worker
from contracts.queue_keys import Checked
from contracts.records import ErrorCode, FinishReason, OutputRecord
from kvstore.client import KVClient

__all__ = ["Session"]

log = logging.getLogger("pagedserve.compute")


class Session:
    """One connection's life of worker ``worker_id``: its requests and their bookkeeping. Owns
    the records and acks of the requests it ended early (``end``), until ``take_ended``."""

    def __init__(
        self,
        kv: KVClient,
        r: redis.Redis,
        worker_id: str,
        config: SchedulerConfig,
        block_size: int,
        runner: ModelRunner,
        decode: Callable[[Sequence[int]], str],
        eos_ids: Collection[int],
        grammars: Callable[[], Grammars],
        limits: ModelLimits,
        phase_s: Mapping[str, float],
        claim_idle_ms: int,
        passthrough: tuple[type[BaseException], ...],
        stream: str = queue_keys.REQUEST_STREAM,
    ) -> None:
        """Starts from empty state (``open`` takes the worker's pending requests back).
        ``phase_s``: the model step's phase totals to go on from (the session before's);
        ``passthrough``: the errors no request's fault boundary keeps (the engine's
        ``RECOVERABLE``); ``stream``: the request stream of the worker's pool."""
        self.stream = stream
        self.scheduler = Scheduler(config, block_size)
        self.requests = Requests(self.scheduler, decode, eos_ids, worker_id, grammars)
        self.kvsync = KVSync(kv, worker_id, self.requests)
        self.faults = Faults(passthrough)  # requests whose own work raised, to end
        self.model = ModelStep(
            runner,
            self.requests,
            decode,
            phase_s,
            self.faults,
            free=self.kvsync.free,
            owed_copies=self.kvsync.take_copies,
        )
        self.intake = Intake(
            r,
            worker_id,
            claim_idle_ms,
            self.requests,
            self.model.free_later,
            self.faults,
            limits,
            stream,
        )
        self._finals: list[OutputRecord] = []  # ended requests' records, to publish
        self._acks: list[str] = []  # their entries, to ack

    def open(self, r: redis.Redis, worker_id: str, redeliver: bool) -> None:
        """Takes back from Redis the requests pending for ``worker_id`` (``redeliver``: as a
        new delivery)."""
        queue_worker.ensure_group(r, self.stream)
        for entry_id, record in queue_worker.claim_own(r, worker_id, redeliver, stream=self.stream):
            self.intake.take_over(entry_id, record)

    @property
    def idle(self) -> bool:
        """No request in hand, no step on the device and no ended request to publish."""
        return (
            not self.requests.active
            and not self.intake.incoming
            and not self._finals
            and not self.model.on_device
        )

    def room(self, max_held: int) -> int:
        """How many more requests may be read (``SchedulerConfig.max_held``)."""
        return max_held - len(self.requests.active) - len(self.intake.incoming)

    def drop(self) -> None:
        """Gives up on what is in flight (the kvstore's reply, the device's steps), before the
        engine opens a new session."""
        self.kvsync.forget()  # its reply is not waited for: the state is rebuilt
        self.model.drop()

    # ------------------------------------------------------------------ ending requests
    def end(
        self,
        active: Active,
        reason: FinishReason,
        error: str | None = None,
        code: ErrorCode | None = None,
    ) -> None:
        """Ends a request before it finished (a client abort, its gateway gone, a refusal, a
        fault): its sequences are forgotten now and freed at the kvstore once no launched step
        writes them; its final record is published and its entry acked in the next Redis round
        trip."""
        if active.record.req_id not in self.requests.active:  # ended already
            return
        self.model.free_later(self.requests.remove(active))
        final = OutputRecord(
            active.record.req_id,
            finish_reason=reason,
            error=error,
            error_code=code,
            prompt_tokens=len(active.record.prompt_token_ids),
            cached_tokens=active.cached_tokens,
            final=True,
        )
        self._finals.append(final)
        self._acks.append(active.entry_id)

    def end_faults(self) -> None:
        """Ends the requests whose own work raised (``compute.faults``) with their error."""
        for fault in self.faults.take():
            active = self.requests.active.get(fault.req_id)
            if active is not None:
                self.end(active, "error", fault.message, fault.code)

    def end_refused(self, refusals: list[Refusal]) -> None:
        """Ends the requests the kvstore refused for good (once each)."""
        for refusal in {id(r.active): r for r in refusals}.values():
            log.error("request %s failed: %s", refusal.active.record.req_id, refusal.message)
            self.end(refusal.active, "error", refusal.message, refusal.code)

    def end_checked(self, checked: Checked | None) -> None:
        """Ends the requests a Redis job found aborted, and those of the gateways gone
        (``Intake.gone``)."""
        if checked is None:
            return
        active = self.requests.active
        for req_id in checked.aborted:
            if req_id in active:
                self.end(active[req_id], "abort")
        for gateway in self.intake.gone(checked.gateways_gone):
            orphans = [a for a in active.values() if a.record.gateway == gateway]
            log.warning("gateway %s is gone: aborting its %d requests", gateway, len(orphans))
            for request in orphans:
                self.end(request, "error", f"its gateway {gateway} is gone", "unavailable")

    def take_ended(self) -> tuple[list[OutputRecord], list[str]]:
        """The final records of the requests ended early and their entries to ack; forgets
        them."""
        ended = self._finals, self._acks
        self._finals, self._acks = [], []
        return ended
