"""KVCacheManager: request -> block tables over a ``BlockStore`` (the GPU ``BlockPool``, the
``CpuTier`` and the ``PrefixIndex``), its priced choices in ``CostChoices``; the block work of
one request in ``request_blocks`` and ``adoption``. Pure Python; the daemon's loop calls it.

Contracts:
- A request's tokens are ``token_ids``; the KV of ``token_ids[:num_computed]`` is written. The
  worker reports ``num_computed`` in ``append``; full blocks are registered in the prefix index
  only once computed, so no request can hit a block whose bytes are not there yet.
- Copy-on-write: before a block that is shared (ref > 1) or registered in the index is written,
  ``append`` swaps it for a fresh block and returns the ``(src, dst)`` copy. **The caller (the
  compute worker) performs the copy** on its own stream before the forward that writes the block:
  ordered with its writes, no cross-process synchronisation.
- Swap: ``preempt``/``resume`` return a ``TransferPlan``; **the daemon executes it before its next
  call into the manager** (the manager has already released the source ids).
- CPU prefix tier: demotions and loads of prefix blocks queue in ``store.pending``; the daemon
  runs ``take_pending()`` before any other plan and before it replies (see ``BlockStore``).
"""

from __future__ import annotations

from kvstore.adoption import (
    check_room,
    drop_computed,
    expired_orphans,
    make_room_for_streamed,
    orphan,
    replace_untrusted,
    shared_prefix,
)
from kvstore.block_pool import BlockPool, CpuTier
from kvstore.block_store import BlockStore
from kvstore.choices import CostChoices
from kvstore.cost_model import DecisionLog, Mode
from kvstore.integrity import check_integrity
from kvstore.prefix_index import LookupResult, PrefixIndex
from kvstore.pricing import Pricing
from kvstore.request_blocks import (
    append_decodes,
    extend_hashes,
    grow,
    register_computed,
    reopen_last_token,
    truncate,
    trusted_blocks,
)
from kvstore.requests import (
    Growth,
    KVError,
    Placement,
    Request,
    Status,
    TransferPlan,
    cdiv,
    table_blocks,
)


class KVCacheManager:
    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int = 16,
        watermark: float = 0.0,
        cpu_prefix_cache: bool = False,
        demote_at_eviction: int | None = None,
    ) -> None:
        """``watermark``: the share of GPU blocks admission and resume leave for growing requests;
        ``cpu_prefix_cache``, ``demote_at_eviction``: the CPU prefix tier (``BlockStore``)."""
        self.block_size = block_size
        self.watermark_blocks = int(num_gpu_blocks * watermark)
        self.store = BlockStore(
            num_gpu_blocks, num_cpu_blocks, block_size, cpu_prefix_cache, demote_at_eviction
        )
        self.requests: dict[str, Request] = {}
        self.choices = CostChoices()

    @property
    def pricing(self) -> Pricing:  # the choices' (the daemon sets its calibration)
        return self.choices.pricing

    @property
    def decisions(self) -> DecisionLog:  # the choices' log (the stats read it)
        return self.choices.log

    @property
    def pool(self) -> BlockPool:
        return self.store.pool

    @property
    def cpu(self) -> CpuTier:
        return self.store.cpu

    @property
    def index(self) -> PrefixIndex:
        return self.store.index

    def take_pending(self) -> TransferPlan:
        """Demotion and load copies queued since the last call: run them now, swap-outs first."""
        return self.store.take_pending()

    # ------------------------------------------------------------------ admission
    def admit(
        self,
        req_id: str,
        worker: str,
        token_ids: list[int],
        salt: bytes | None,
        reuse_prefix: bool = True,
        now: float = 0.0,
    ) -> Placement:
        """New request: reuse its longest cached prefix (not with ``reuse_prefix`` False, now
        or after a preemption), blocks for the other tokens; a prefix going on in the CPU tier
        is loaded back (``take_pending``) or recomputed, as the cost model says."""
        if req_id in self.requests:
            raise KVError("duplicate_request", f"request {req_id!r} already exists")
        if not token_ids:
            raise KVError("bad_argument", "a request needs at least one token")
        request = Request(req_id, worker, salt, list(token_ids), reuse_prefix=reuse_prefix)
        extend_hashes(request, self.block_size)
        placement = self._place(request, record=True, now=now)
        self.requests[req_id] = request
        return placement

    def adopt(
        self, req_id: str, worker: str, token_ids: list[int], reuse_prefix: bool = True
    ) -> tuple[Placement, TransferPlan]:
        """A worker takes over an orphaned request (its worker died). The stored tokens are cut
        to their longest common prefix with ``token_ids`` (what the new worker read back), then
        extended with the rest (streamed, never reported: the new worker computes them from
        ``num_computed``). A preempted request is resumed. ``reuse_prefix`` False: what the
        request computed is dropped, and it is placed again without a prefix lookup."""
        request = self._get(req_id)
        if request.orphaned_at is None and request.worker != worker:
            raise KVError("conflict", f"request {req_id!r} is held by live worker {request.worker}")
        bs = self.block_size
        common = shared_prefix(request, token_ids)
        check_room(self.store, request, token_ids, common, reuse_prefix, bs)
        request.worker, request.orphaned_at = worker, None
        if not reuse_prefix:
            drop_computed(self.store, request)
        truncate(self.store, request, common, bs)
        if request.status is Status.RUNNING:
            replace_untrusted(self.store, request, bs)
        streamed = token_ids[common:]  # what the dead worker streamed but never reported
        request.token_ids.extend(streamed)  # known now, computed by the new worker
        extend_hashes(request, bs)
        if request.status is not Status.RUNNING:
            try:
                return self._resume_one(request)
            except KVError:  # all or nothing: as it was, the streamed tokens not taken on
                truncate(self.store, request, common, bs)
                raise
        if streamed:
            make_room_for_streamed(self.store, request, bs)
        reopen_last_token(self.store, request, bs)
        placement = Placement(
            req_id, list(request.block_ids), request.num_computed, request.num_cached_tokens
        )
        return placement, TransferPlan()

    def copied(self, worker: str, blocks: list[int]) -> None:
        """``worker`` made the copy-on-write copies into ``blocks`` (``Step.copied``): trusted."""
        self.pool.copied(worker, blocks)

    @property
    def admission_limit_blocks(self) -> int:
        """The most blocks one request may need and still be placed: the pool less the
        watermark (when every other block is free or cached, it fits)."""
        return self.pool.num_blocks - self.watermark_blocks

    def _place(self, request: Request, record: bool, now: float = 0.0) -> Placement:
        """Prefix lookup + allocation of the rest; sets the request RUNNING. All or nothing.
        Raises ``too_large`` if the request can never be placed, ``no_space`` if not now. Only
        an admission (``record``) may load prefix blocks back from the CPU tier."""
        bs, num_tokens = self.block_size, len(request.token_ids)
        total = table_blocks(num_tokens, bs)
        if total > self.admission_limit_blocks:
            raise KVError(
                "too_large",
                f"{num_tokens} tokens need {total} KV blocks; one request may hold "
                f"at most {self.admission_limit_blocks} ({self.pool.num_blocks} in the pool, "
                f"{self.watermark_blocks} kept free)",
            )
        hit = LookupResult([], [], "no_entry")  # uncounted: the request asked for no reuse
        if request.reuse_prefix:
            hit = self.index.lookup(request.keys, request.contents, num_tokens, record)
        used = hit.gpu_run
        missing = [i for i in range(used, len(hit.gpu)) if hit.gpu[i] is None]
        choice, running = None, 0
        if record and missing:
            worker, on = request.worker, Status.RUNNING  # a load shares the GPU with their steps
            running = sum(r.worker == worker and r.status is on for r in self.requests.values())
            choice = self.choices.prefix(request, hit, missing, running, bs)
        load = choice is not None and choice.mode == "load"
        used = len(hit.gpu) if load else used
        gpu_hits = [b for b in hit.gpu[:used] if b is not None]
        needed = total - len(gpu_hits)
        evictable_hits = sum(1 for b in gpu_hits if self.pool.ref_counts[b] == 0)
        available = self.pool.num_available - evictable_hits - self.watermark_blocks
        if needed > available:
            raise KVError(
                "no_space",
                f"need {needed} blocks, {available} available above the "
                f"{self.watermark_blocks}-block watermark",
            )
        if choice is not None:
            request.decision_id = self.choices.log_prefix(
                request, hit, missing, choice, now, running > 0, bs
            )
            if choice.mode != "load":
                self.store.counts["recomputed"] += len(missing)
        for block in gpu_hits:
            self.pool.ref(block)
        table: list[int | None] = list(hit.gpu[:used])
        if load:
            keys = [request.keys[i] for i in missing]
            cpu_blocks = [hit.cpu[i] for i in missing]
            assert request.decision_id is not None
            loaded = self.store.load(keys, cpu_blocks, request.decision_id)  # type: ignore[arg-type]
            for i, block in zip(missing, loaded, strict=True):
                table[i] = block
        request.block_ids = [b for b in table if b is not None] + self.store.allocate(total - used)
        assert len(request.block_ids) == total
        request.num_computed, request.num_registered = used * bs, used
        if record:  # the hit the client sees is the one at admission
            request.num_cached_tokens = request.num_computed
            self.index.count_hits(request.keys[:used], len(missing) if load else 0)
        request.status = Status.RUNNING
        return Placement(
            request.req_id, list(request.block_ids), request.num_computed, request.num_cached_tokens
        )

    # ------------------------------------------------------------------ growth
    def append(
        self, req_id: str, worker: str, new_token_ids: list[int], num_computed: int
    ) -> Growth:
        """Adds tokens and records that the KV of the first ``num_computed`` tokens is written
        (the new ones may count: a worker that feeds a sampled token to its next step from the
        device computes it before reporting it, in a slot its table already has). Allocates
        blocks for the new tokens and private copies of shared blocks about to be written;
        registers newly computed full blocks in the prefix index. All or nothing."""
        request = self._owned(req_id, worker, Status.RUNNING)
        return grow(self.store, request, new_token_ids, num_computed, self.block_size)

    def append_tokens(
        self, worker: str, req_ids: list[str], token_ids: list[int], num_computed: list[int]
    ) -> list[int]:
        """The decode step's bulk: one token for each request, in a tight loop. Applies every
        item that takes the common path (its token goes into a block the request owns alone and
        does not fill, its table needs no new block, every earlier token computed) and returns
        the indices of the others, left untouched, for the general ``append`` (a new block, a
        full block to hash, a copy-on-write, a block to register, an error)."""
        return append_decodes(
            self.requests, self.pool, self.block_size, worker, req_ids, token_ids, num_computed
        )

    def fork(self, parent_id: str, worker: str, child_id: str) -> Placement:
        """The child shares every block of the parent (ref + 1 each): tokens, computed count and
        hashes are copied. The first write into a shared block copies it (see ``append``)."""
        parent = self._owned(parent_id, worker, Status.RUNNING)
        if child_id in self.requests:
            raise KVError("duplicate_request", f"request {child_id!r} already exists")
        for block in parent.block_ids:
            self.pool.ref(block)
        self.requests[child_id] = Request(
            child_id,
            worker,
            parent.salt,
            list(parent.token_ids),
            parent.num_computed,
            list(parent.block_ids),
            contents=list(parent.contents),
            keys=list(parent.keys),
            num_registered=parent.num_registered,
            num_cached_tokens=parent.num_cached_tokens,
        )
        return Placement(
            child_id, list(parent.block_ids), parent.num_computed, parent.num_cached_tokens
        )

    def free(self, req_id: str, worker: str | None) -> None:
        """Drops the request and its blocks (cached ones stay in the LRU); ``worker`` None:
        whoever owns it (lease reclamation, admin)."""
        request = self._get(req_id) if worker is None else self._owned(req_id, worker, None)
        self.pool.release(request.block_ids)
        self.cpu.release(request.cpu_block_ids)
        del self.requests[req_id]

    # ------------------------------------------------------------------ preemption
    def preempt(
        self, req_ids: list[str], worker: str, now: float
    ) -> tuple[list[Mode], TransferPlan]:
        """Preempts running requests, each by swap or recompute per the cost model: the modes
        and the swap-out plan (run before the next manager call)."""
        victims = [self._owned(req_id, worker, Status.RUNNING) for req_id in req_ids]  # all or none
        plan = TransferPlan()
        return [self._preempt_one(victim, now, plan) for victim in victims], plan

    def _preempt_one(self, request: Request, now: float, plan: TransferPlan) -> Mode:
        """Swaps out the blocks that hold tokens (not the lookahead slots past them), or drops
        them all."""
        blocks = request.block_ids[: cdiv(len(request.token_ids), self.block_size)]
        # demoted prefixes make room for a swap: the CPU tier's available blocks count them
        choice, request.decision_id = self.choices.preempt(
            request, len(blocks), self.cpu.num_available, now
        )
        request.preemptions += 1
        if choice.mode == "swap":  # what an unconfirmed copy should hold is computed again
            trusted = trusted_blocks(self.store, request) * self.block_size
            request.num_computed = min(request.num_computed, trusted)
            request.cpu_block_ids = self.store.allocate_cpu(len(blocks))
            plan.swap_out.extend(zip(blocks, request.cpu_block_ids, strict=True))
            plan.decisions[request.decision_id] = len(blocks)
            request.status = Status.SWAPPED
        else:
            request.status = Status.DROPPED
            request.num_computed = 0
        self.pool.release(request.block_ids)
        request.block_ids = []
        request.num_registered = 0
        return "swap" if choice.mode == "swap" else "recompute"

    def resume(self, req_id: str, worker: str) -> tuple[Placement, TransferPlan]:
        """Gives a preempted request blocks again. Swapped: cached prefix blocks are reused, the
        rest swapped in (plan). Dropped: like admission; the worker recomputes from num_computed."""
        request = self._owned(req_id, worker, None)
        if request.status is Status.RUNNING:
            raise KVError("wrong_state", f"request {req_id!r} is running")
        return self._resume_one(request)

    def _resume_one(self, request: Request) -> tuple[Placement, TransferPlan]:
        if request.status is Status.DROPPED:
            return self._place(request, record=False), TransferPlan()
        plan, num_computed = TransferPlan(), request.num_computed
        placement = self._place(request, record=False)
        reused = placement.num_computed // self.block_size
        swapped = len(request.cpu_block_ids)  # an adopted one may have grown past them
        plan.swap_in = list(
            zip(request.cpu_block_ids[reused:], request.block_ids[reused:swapped], strict=True)
        )
        if request.decision_id is not None:
            plan.decisions[request.decision_id] = len(plan.swap_in)
        self.cpu.release(request.cpu_block_ids)
        request.cpu_block_ids = []
        request.num_computed = max(num_computed, placement.num_computed)
        reopen_last_token(self.store, request, self.block_size)
        register_computed(self.store, request, self.block_size)
        table, cached = list(request.block_ids), placement.num_cached_tokens
        return Placement(request.req_id, table, request.num_computed, cached), plan

    def record_transfer(self, plan: TransferPlan, out_s: float, in_s: float) -> None:
        """The measured times of an executed plan (``CostChoices.transferred``)."""
        self.choices.transferred(plan, out_s, in_s)

    def record_recompute(self, req_id: str, seconds: float) -> None:
        """A worker's measured time to recompute a request preempted for recompute."""
        request = self.requests.get(req_id)
        if request is None or request.decision_id is None:
            raise KVError("unknown_request", f"no preemption decision for {req_id!r}")
        self.choices.log.add_actual(request.decision_id, seconds)

    # ------------------------------------------------------------------ leases and admin
    def orphan_worker(self, worker: str, now: float) -> list[str]:
        """Marks a dead worker's requests orphaned; they keep their blocks until reclaimed."""
        return orphan(self.store, self.requests.values(), worker, now)

    def reclaim_orphans(self, now: float, grace_s: float) -> list[str]:
        """Frees requests orphaned for longer than ``grace_s``."""
        expired = expired_orphans(self.requests.values(), now, grace_s)
        for req_id in expired:
            self.free(req_id, None)
        return expired

    def reset_prefix_cache(self) -> int:
        """Unregisters every cached block of both tiers (idle ones become free); how many."""
        dropped = self.store.reset()
        for request in self.requests.values():
            if request.status is Status.RUNNING:  # its computed blocks are not offered again
                request.num_registered = request.num_computed // self.block_size
        return dropped

    def check_integrity(self) -> None:
        """Raises AssertionError where the blocks and the tables disagree (``integrity``)."""
        check_integrity(self.store, self.requests, self.block_size)

    # ------------------------------------------------------------------ internals
    def _get(self, req_id: str) -> Request:
        request = self.requests.get(req_id)
        if request is None:
            raise KVError("unknown_request", f"unknown request {req_id!r}")
        return request

    def _owned(self, req_id: str, worker: str, status: Status | None) -> Request:
        request = self._get(req_id)
        if request.worker != worker:
            raise KVError("not_owner", f"request {req_id!r} belongs to worker {request.worker}")
        if status is not None and request.status is not status:
            raise KVError("wrong_state", f"request {req_id!r} is {request.status.value}")
        return request
