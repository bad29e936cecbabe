"""The daemon's request handlers: one ``KVService`` turns protocol bodies into manager calls.

Torch-free: the pool side is any object with ``swap_out``/``swap_in`` returning seconds and an
``export()`` (``kvstore.device.DevicePools`` in the daemon). Called only from the daemon's
single-threaded loop, so the manager is never touched concurrently.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from kvstore import protocol as p
from kvstore.leases import Leases, Worker
from kvstore.manager import KVCacheManager
from kvstore.requests import KVError, Placement, TransferPlan
from kvstore.stats import block_info, block_map, build_stats

log = logging.getLogger("pagedserve.kvstore")
# bytes per write-back pass between calls: ~0.15 ms at 55 GB/s, whatever the block size (a pass
# of 64 blocks, 128 MiB of the 8B shape's, held the next Step ~2 ms: BENCHMARKS-archive.md,
# ninth pass)
WRITE_BACK_BYTES = 8 << 20


PrepareAdmit = Callable[[p.AdmitItem], list[int]]


class Mover(Protocol):
    block_bytes: int

    def swap_out(self, pairs: list[tuple[int, int]]) -> float: ...
    def swap_in(self, pairs: list[tuple[int, int]]) -> float: ...
    def export(self) -> p.PoolInfo: ...


class KVService:
    def __init__(
        self,
        manager: KVCacheManager,
        mover: Mover,
        lease_timeout_s: float,
        orphan_grace_s: float,
        clock: Callable[[], float] = time.monotonic,
        write_back_ahead: int = 0,
    ) -> None:
        self.manager, self.mover, self.clock = manager, mover, clock
        self.write_back_ahead = write_back_ahead
        self.leases = Leases(lease_timeout_s)
        self.orphan_grace_s = orphan_grace_s
        self.started = clock()
        self._pool_info = mover.export()
        self.busy_s: dict[str, float] = {}  # seconds of copies by kind (``Stats.busy_s``)

    # ------------------------------------------------------------------ dispatch
    def handle(self, body: p.Request, prepare_admit: PrepareAdmit | None = None) -> p.ReplyBody:
        """``prepare_admit``: called before each admission of a ``Step`` that reuses prefixes,
        returns blocks it holds once each, released once the admission ran (the ``Host``'s
        copies from other pools)."""
        now = self.clock()
        match body:
            case p.Step():
                if not self.leases.touch(body.worker_id, now):
                    return p.Error("unknown_worker", f"worker {body.worker_id!r} must register")
                reply = self.step(body, now, prepare_admit)
                self.leases.touch(body.worker_id, self.clock())
                if body.timeline is not None:
                    self.leases.workers[body.worker_id].timeline = body.timeline
                    self.leases.workers[body.worker_id].timeline_at = now
                return reply
            case p.Heartbeat():
                if not self.leases.touch(body.worker_id, now):
                    return p.Error("unknown_worker", f"worker {body.worker_id!r} must register")
                return p.Ack()
            case p.Register():
                return self.register(body, now)
            case p.Unregister():
                self.leases.remove(body.worker_id)
                orphaned = self.manager.orphan_worker(body.worker_id, now)
                log.info("worker %s left; %d requests orphaned", body.worker_id, len(orphaned))
                return p.Ack()
            case p.GetStats():
                stats = build_stats(
                    self.manager, self.mover.block_bytes, self.leases, body.top_prefixes, now
                )
                return msgspec.structs.replace(stats, busy_s=dict(self.busy_s))
            case p.ResetCache():
                blocks = self.manager.reset_prefix_cache()
                log.info("prefix cache reset: %d blocks unregistered", blocks)
                return p.CacheReset(blocks)
            case p.Ping():
                return p.Pong(now - self.started)
            case p.GetBlockMap():
                return block_map(self.manager)
            case p.GetBlockInfo():
                return block_info(self.manager, body.tier, body.block)
        return p.Error("bad_message", f"unhandled message {type(body).__name__}")

    def register(self, body: p.Register, now: float) -> p.Registered:
        """A worker (re)joins. What the daemon still holds under its id belongs to a previous
        life of it (a restarted process, or one that lost track of us): orphaned, adoptable."""
        self.leases.register(Worker(body.worker_id, now, now, body.device, body.pid))
        self.manager.pricing.register(
            body.worker_id,
            body.prefill_profile,
            body.recompute_profile,
            body.graph_token_buckets,
            body.profile_origin,
        )
        orphaned = self.manager.orphan_worker(body.worker_id, now)
        log.info(
            "worker %s registered (pid %d, %s, %d prefill and %d recompute points, %s)%s",
            body.worker_id,
            body.pid,
            body.device,
            len(body.prefill_profile),
            len(body.recompute_profile),
            body.profile_origin.source if body.profile_origin else "profile of unknown origin",
            f"; {len(orphaned)} requests of its previous registration orphaned" if orphaned else "",
        )
        return p.Registered(
            self._pool_info,
            self.manager.pool.num_blocks,
            self.manager.cpu.num_blocks,
            self.leases.timeout_s,
            self.manager.admission_limit_blocks,
        )

    def tick(self) -> None:
        """Expires leases of silent workers and frees requests orphaned past the grace period."""
        now = self.clock()
        for worker in self.leases.expire(now):
            orphaned = self.manager.orphan_worker(worker, now)
            log.warning(
                "worker %s lease expired; %d requests orphaned for %.0f s",
                worker,
                len(orphaned),
                self.orphan_grace_s,
            )
        reclaimed = self.manager.reclaim_orphans(now, self.orphan_grace_s)
        if reclaimed:
            log.warning("reclaimed %d orphaned requests: %s", len(reclaimed), reclaimed[:8])

    # ------------------------------------------------------------------ the per-step call
    def step(
        self, body: p.Step, now: float, prepare_admit: PrepareAdmit | None = None
    ) -> p.StepReply:
        m, worker, reply = self.manager, body.worker_id, p.StepReply()
        admit = functools.partial(self._admit, prepare=prepare_admit)
        for cost in body.costs:
            self._each(reply, "cost", cost.req_id, m.record_recompute, cost.req_id, cost.seconds)
        m.copied(worker, body.copied)  # before appends: the blocks they complete may join the index
        for fork in body.forks:  # before frees: a child may end, or its parent, in this step
            for child in fork.child_ids:
                self._each(reply, "fork", child, self._fork, fork.parent_id, child, worker, reply)
        for item in body.finals:  # computed blocks join the index before they are freed
            args = (item.req_id, worker, item.token_ids, item.num_computed)
            self._each(reply, "final", item.req_id, m.append, *args)
        for req_id in body.frees:
            self._each(reply, "free", req_id, m.free, req_id, worker)
        for req_id in body.preempts:
            self._each(reply, "preempt", req_id, self._preempt, req_id, worker, now, reply)
        for item in body.appends:
            self._append(reply, worker, item.req_id, item.token_ids, item.num_computed)
        if body.tokens is not None:
            self._append_tokens(reply, worker, body.tokens)
        placements: list[tuple[str, p.ItemOp, Callable[..., None], object]] = [
            (r, "resume", self._resume, r) for r in body.resumes
        ]
        placements += [(item.req_id, "admit", admit, item) for item in body.admits]
        blocked = False  # first come, first served: nothing is placed past a refusal for space
        for req_id, op, place, arg in placements:
            if blocked:
                message = "an earlier request of this step is waiting for space"
                reply.errors.append(p.ItemError(req_id, op, "no_space", message))
                continue
            errors = len(reply.errors)
            self._each(reply, op, req_id, place, arg, worker, reply, now)
            blocked = len(reply.errors) > errors and reply.errors[-1].code == "no_space"
        self._run(TransferPlan())  # the step's demotions and prefix loads, before the reply
        return reply

    def between_calls(self, limit: int | None = None) -> int:
        """Copies up to ``limit`` (default: ``WRITE_BACK_BYTES`` worth) of the next GPU victims'
        cached blocks to the CPU tier ahead of their eviction (the daemon calls it between
        messages, when none waits: off every request's critical path, and bounded so that the
        next message waits little). Returns how many."""
        if not self.write_back_ahead:
            return 0
        if limit is None:
            limit = max(1, WRITE_BACK_BYTES // self.mover.block_bytes)
        queued = self.manager.store.plan_write_back(self.write_back_ahead, limit)
        if queued:
            self._run(TransferPlan(), pending_kind="write_back")
        return queued

    def _append(
        self, reply: p.StepReply, worker: str, req_id: str, tokens: list[int], computed: int
    ) -> None:
        try:
            growth = self.manager.append(req_id, worker, tokens, computed)
        except KVError as err:
            reply.errors.append(p.ItemError(req_id, "append", err.code, str(err)))
            return
        if growth.new_block_ids or growth.copies:
            reply.appended.append(p.Grown(growth.req_id, growth.new_block_ids, growth.copies))

    def _append_tokens(self, reply: p.StepReply, worker: str, batch: p.TokenBatch) -> None:
        ids, tokens, computed = batch.req_ids, batch.token_ids, batch.num_computed
        if not len(ids) == len(tokens) == len(computed):
            message = (
                f"TokenBatch lists differ in length: {len(ids)}, {len(tokens)}, {len(computed)}"
            )
            reply.errors.append(p.ItemError("", "append", "bad_argument", message))
            return
        for i in self.manager.append_tokens(worker, ids, tokens, computed):
            self._append(reply, worker, ids[i], [tokens[i]], computed[i])

    @staticmethod
    def _each(
        reply: p.StepReply, op: p.ItemOp, req_id: str, fn: Callable[..., object], *args: object
    ) -> None:
        """Runs one item of a step; a KVError becomes that item's error, the step goes on."""
        try:
            fn(*args)
        except KVError as err:
            reply.errors.append(p.ItemError(req_id, op, err.code, str(err)))

    def _fork(self, parent: str, child: str, worker: str, reply: p.StepReply) -> None:
        reply.forked.append(placed(self.manager.fork(parent, worker, child)))

    def _admit(
        self,
        item: p.AdmitItem,
        worker: str,
        reply: p.StepReply,
        now: float,
        prepare: PrepareAdmit | None = None,
    ) -> None:
        if item.adopt:
            placement, plan = self.manager.adopt(
                item.req_id, worker, item.token_ids, item.reuse_prefix
            )
            self._run(plan)
        else:
            held = prepare(item) if prepare is not None and item.reuse_prefix else []
            try:
                placement = self.manager.admit(
                    item.req_id, worker, item.token_ids, item.salt, item.reuse_prefix, now
                )
            finally:
                self.manager.pool.release(held)
        reply.admitted.append(placed(placement))

    def run_pending(self) -> None:
        """Runs the manager's queued demotions and loads now (before their GPU blocks are
        written by anything else, as a copy from another pool would)."""
        self._run(TransferPlan())

    def _preempt(self, req_id: str, worker: str, now: float, reply: p.StepReply) -> None:
        (mode,), plan = self.manager.preempt([req_id], worker, now)
        self._run(plan)
        reply.preempted.append((req_id, mode))

    def _resume(self, req_id: str, worker: str, reply: p.StepReply, _now: float) -> None:
        placement, plan = self.manager.resume(req_id, worker)
        self._run(plan)
        reply.resumed.append(placed(placement))

    def _run(self, plan: TransferPlan, pending_kind: str = "tier_copies") -> None:
        """Executes the manager's queued demotions and prefix loads, then ``plan``, now: before
        any other manager call may reuse their source blocks. Their seconds count in
        ``busy_s``: the queued copies as ``pending_kind``, ``plan`` as ``swaps``."""
        for part in (self.manager.take_pending(), plan):
            if not (part.swap_out or part.swap_in):
                continue
            out_s = self.mover.swap_out(part.swap_out) if part.swap_out else 0.0
            in_s = self.mover.swap_in(part.swap_in) if part.swap_in else 0.0
            kind = "swaps" if part is plan else pending_kind
            self.busy_s[kind] = self.busy_s.get(kind, 0.0) + out_s + in_s
            self.manager.record_transfer(part, out_s, in_s)
            log.log(
                logging.DEBUG if part is not plan else logging.INFO,
                "%s: %d blocks out, %d in, %.2f ms",
                "swap" if part is plan else "prefix tier",
                len(part.swap_out),
                len(part.swap_in),
                (out_s + in_s) * 1e3,
            )


def placed(placement: Placement) -> p.Placed:
    """The wire form of a manager's ``Placement``."""
    return p.Placed(
        placement.req_id, placement.block_ids, placement.num_computed, placement.num_cached_tokens
    )
