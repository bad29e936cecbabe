"""KVCacheManager: request -> block tables over a ``BlockStore`` (the GPU ``BlockPool``, the
``CpuTier`` and the ``PrefixIndex``). Pure Python, no torch; the daemon's single-threaded loop is
its only caller.

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

from kvstore.block_pool import BlockPool, CpuTier
from kvstore.block_store import BlockStore
from kvstore.cost_model import Choice, DecisionLog, Mode
from kvstore.integrity import check_integrity
from kvstore.prefix_index import LookupResult, PrefixIndex
from kvstore.pricing import Pricing
from kvstore.protocol import LOOKAHEAD_SLOTS
from kvstore.request_blocks import (
    extend_hashes,
    must_copy,
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
    ) -> None:
        """``watermark``: the fraction of GPU blocks that admission and resume leave free, so that
        running requests can still grow (appends may use them). ``cpu_prefix_cache``: evicted
        prefix blocks are kept in the CPU tier (see ``BlockStore``)."""
        self.block_size = block_size
        self.watermark_blocks = int(num_gpu_blocks * watermark)
        self.store = BlockStore(num_gpu_blocks, num_cpu_blocks, block_size, cpu_prefix_cache)
        self.decisions = DecisionLog()
        self.requests: dict[str, Request] = {}
        self.pricing = Pricing()
        self._load_busy: dict[int, bool] = {}  # queued prefix loads: decision id -> busy

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
        """New request: reuse its longest cached prefix (unless ``reuse_prefix`` is False, for
        this placement and any after a preemption), allocate blocks for every other token. A
        prefix that goes on in the CPU tier is loaded back (queued in ``take_pending``) or left
        for the worker to recompute, as the cost model says."""
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
        to their longest common prefix with ``token_ids`` (what the new worker read back from the
        output stream), then extended with the rest: a dead worker may have streamed tokens it
        never reported, and the new worker computes them from ``num_computed``, in blocks the
        table has for them. A preempted request is resumed. With
        ``reuse_prefix`` False the worker needs every token's logits: what the request computed
        is dropped, and it is placed again without a prefix lookup."""
        request = self._get(req_id)
        if request.orphaned_at is None and request.worker != worker:
            raise KVError("conflict", f"request {req_id!r} is held by live worker {request.worker}")
        common = 0
        for mine, theirs in zip(request.token_ids, token_ids, strict=False):
            if mine != theirs:
                break
            common += 1
        if common == 0:
            raise KVError(
                "bad_argument", f"tokens of {req_id!r} share no prefix with the kvstore's"
            )
        bs = self.block_size
        streamed = token_ids[common:]  # what the dead worker streamed but never reported
        last_block = request.block_ids[(common - 1) // bs] if request.block_ids else 0
        reopens_in_a_fresh_block = (
            request.status is Status.RUNNING
            and not streamed
            and min(request.num_computed, common) == common
            and must_copy(self.store, last_block)
        )
        if request.status is Status.RUNNING and reuse_prefix:  # check before changing
            kept = min(len(request.block_ids), table_blocks(common, bs))
            # streamed tokens: their blocks, and maybe a fresh one where writing resumes
            grows = table_blocks(len(token_ids), bs) - kept + 1 if streamed else 0
            untrusted = max(0, kept - trusted_blocks(self.store, request))
            needed = int(reopens_in_a_fresh_block) + grows + untrusted
            if needed > self.pool.num_available:
                raise KVError("no_space", f"no {needed} blocks to take {req_id!r} over")
        request.worker, request.orphaned_at = worker, None
        if not reuse_prefix:
            self.pool.release(request.block_ids)
            self.cpu.release(request.cpu_block_ids)
            request.block_ids, request.cpu_block_ids = [], []
            request.num_computed = request.num_registered = 0
            request.status, request.reuse_prefix = Status.DROPPED, False
        truncate(self.store, request, common, bs)
        if request.status is Status.RUNNING:
            self._replace_untrusted(request)
        request.token_ids.extend(streamed)  # known now, computed by the new worker
        extend_hashes(request, bs)
        if request.status is not Status.RUNNING:
            try:
                return self._resume_one(request)
            except KVError:  # all or nothing: as it was, the streamed tokens not taken on
                truncate(self.store, request, common, bs)
                raise
        if streamed:
            self._make_room_for_streamed(request)
        reopen_last_token(self.store, request, bs)
        placement = Placement(
            req_id, list(request.block_ids), request.num_computed, request.num_cached_tokens
        )
        return placement, TransferPlan()

    def _replace_untrusted(self, request: Request) -> None:
        """A request taken over from a dead worker: its blocks from the first whose
        copy-on-write copy was never confirmed (the worker may have died before making it) are
        replaced by fresh ones, computed again by the new worker. The caller checked that the
        pool has the blocks."""
        first, table = trusted_blocks(self.store, request), request.block_ids
        if first == len(table):
            return
        fresh = self.store.allocate(len(table) - first)
        self.pool.release(table[first:])
        table[first:] = fresh
        request.num_computed = min(request.num_computed, first * self.block_size)
        request.num_registered = min(request.num_registered, first)

    def copied(self, blocks: list[int]) -> None:
        """A worker performed the copy-on-write copies into ``blocks`` (``Step.copied``): their
        content is trusted from now on."""
        self.pool.copied(blocks)

    def _make_room_for_streamed(self, request: Request) -> None:
        """An adopted running request whose tokens outgrew its table (its dead worker streamed
        tokens it never reported): blocks for them, and a private block where the new worker
        starts writing (a shared or registered one is replaced, its tokens computed again).
        The caller checked that the pool has the blocks."""
        bs, table = self.block_size, request.block_ids
        table.extend(self.store.allocate(table_blocks(len(request.token_ids), bs) - len(table)))
        first = request.num_computed // bs  # the first block the new worker writes
        if first < len(table) and must_copy(self.store, table[first]):
            [fresh] = self.store.allocate(1)
            self.pool.release([table[first]])
            table[first] = fresh
            request.num_computed = first * bs
            request.num_registered = min(request.num_registered, first)

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
            running = self._running(request.worker)
            choice = self._prefix_choice(request, hit, missing, running)
        load = choice is not None and choice.mode == "load"
        if load:
            used = len(hit.gpu)
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
            self._record_prefix_decision(request, hit, missing, choice, now, running > 0)
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
        request.num_computed = used * bs
        request.num_registered = used
        if record:  # the hit the client sees is the one at admission
            request.num_cached_tokens = request.num_computed
            self.index.count_hits(request.keys[:used], len(missing) if load else 0)
        request.status = Status.RUNNING
        return Placement(
            request.req_id, list(request.block_ids), request.num_computed, request.num_cached_tokens
        )

    def _prefix_choice(
        self, request: Request, hit: LookupResult, missing: list[int], running: int
    ) -> Choice:
        bs = self.block_size
        return self.pricing.prefix_load(
            request.worker,
            len(missing),
            (len(hit.gpu) - hit.gpu_run) * bs,
            hit.gpu_run * bs,
            max(len(request.token_ids) - len(hit.gpu) * bs, 0),
            running,
        )

    def _running(self, worker: str) -> int:
        """How many requests ``worker`` runs (a load then shares the GPU with their steps)."""
        return sum(
            r.worker == worker and r.status is Status.RUNNING for r in self.requests.values()
        )

    def _record_prefix_decision(
        self,
        request: Request,
        hit: LookupResult,
        missing: list[int],
        choice: Choice,
        now: float,
        busy: bool,
    ) -> None:
        """Logs ``choice``; a load remembers ``busy`` (the worker ran others) for its timing."""
        tokens = (len(hit.gpu) - hit.gpu_run) * self.block_size
        decision = self.decisions.record(
            request.req_id, now, len(missing), tokens, choice, kind="prefix"
        )
        request.decision_id = decision.id
        if choice.mode == "load":
            self._load_busy[decision.id] = busy
        else:
            self.store.counts["recomputed"] += len(missing)

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
        tokens, table, bs = request.token_ids, request.block_ids, self.block_size
        if not request.num_computed <= num_computed <= len(tokens) + len(new_token_ids):
            raise KVError(
                "bad_argument",
                f"num_computed {num_computed} outside [{request.num_computed}, "
                f"{len(tokens) + len(new_token_ids)}] for {req_id!r}",
            )
        blocks_needed = table_blocks(len(tokens) + len(new_token_ids), bs)
        last = min(blocks_needed, len(table))
        to_copy = [i for i in range(num_computed // bs, last) if must_copy(self.store, table[i])]
        grow = blocks_needed - len(table)
        copies: list[tuple[int, int, int]] = []
        new_blocks: list[int] = []
        if grow > 0 or to_copy:  # the common decode step allocates nothing
            needed = max(grow, 0) + len(to_copy)
            if needed > self.pool.num_available:
                raise KVError(
                    "no_space",
                    f"{req_id!r} needs {needed} blocks, {self.pool.num_available} available",
                )
            fresh = self.store.allocate(needed)
            for position, dst in zip(to_copy, fresh, strict=False):
                src = table[position]
                self.pool.release([src])
                self.pool.mark_copying(dst)  # trusted once the worker confirms the copy
                table[position] = dst
                copies.append((position, src, dst))
            new_blocks = fresh[len(to_copy) :]
            table.extend(new_blocks)
        tokens.extend(new_token_ids)
        request.num_computed = num_computed
        if len(tokens) // bs > len(request.contents):
            extend_hashes(request, self.block_size)
        if num_computed // bs > request.num_registered:
            register_computed(self.store, request, self.block_size)
        return Growth(req_id, new_blocks, copies)

    def append_tokens(
        self, worker: str, req_ids: list[str], token_ids: list[int], num_computed: list[int]
    ) -> list[int]:
        """The decode step's bulk: one token for each request, in a tight loop. Applies every
        item that takes the common path (its token goes into a block the request owns alone and
        does not fill, its table needs no new block, every earlier token computed) and returns
        the indices of the others, left untouched, for the general ``append`` (a new block, a
        full block to hash, a copy-on-write, a block to register, an error)."""
        requests, bs, running = self.requests, self.block_size, Status.RUNNING
        refs, cached = self.pool.ref_counts, self.pool.cached
        general: list[int] = []
        for i, (req_id, token, computed) in enumerate(
            zip(req_ids, token_ids, num_computed, strict=True)
        ):
            r = requests.get(req_id)
            if r is None or r.worker != worker or r.status is not running:
                general.append(i)
                continue
            tokens, table = r.token_ids, r.block_ids
            n = len(tokens)
            block, last = table[n // bs], table[-1]
            if (
                computed != n
                or (n + 1) % bs == 0  # fills its block: to hash
                or len(table) * bs < n + 1 + LOOKAHEAD_SLOTS  # the table must grow
                or n // bs != r.num_registered
                or refs[block] > 1
                or cached[block]
                or refs[last] > 1
            ):
                general.append(i)
                continue
            tokens.append(token)
            r.num_computed = n
        return general

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
        """Drops the request and its blocks (GPU blocks keep their cache entries in the LRU).
        ``worker`` None frees regardless of owner (lease reclamation, admin)."""
        request = self._get(req_id) if worker is None else self._owned(req_id, worker, None)
        self.pool.release(request.block_ids)
        self.cpu.release(request.cpu_block_ids)
        del self.requests[req_id]

    # ------------------------------------------------------------------ preemption
    def preempt(
        self, req_ids: list[str], worker: str, now: float
    ) -> tuple[list[Mode], TransferPlan]:
        """Preempts running requests, each by swap or recompute per the cost model. Returns the
        mode per request and the swap-out plan, which must run before the next manager call."""
        victims = [self._owned(req_id, worker, Status.RUNNING) for req_id in req_ids]  # all or none
        plan = TransferPlan()
        return [self._preempt_one(victim, now, plan) for victim in victims], plan

    def _preempt_one(self, request: Request, now: float, plan: TransferPlan) -> Mode:
        """Swaps out the blocks that hold tokens (not the lookahead slots past them), or drops
        them all."""
        blocks = request.block_ids[: cdiv(len(request.token_ids), self.block_size)]
        choice = self.pricing.preempt(
            request.worker,
            len(blocks),
            request.num_computed,
            self.cpu.num_available,  # demoted prefixes make room for a swap
        )
        decision = self.decisions.record(
            request.req_id, now, len(blocks), request.num_computed, choice
        )
        request.decision_id = decision.id
        request.preemptions += 1
        if choice.mode == "swap":  # what an unconfirmed copy should hold is computed again
            trusted = trusted_blocks(self.store, request) * self.block_size
            request.num_computed = min(request.num_computed, trusted)
            request.cpu_block_ids = self.store.allocate_cpu(len(blocks))
            plan.swap_out.extend(zip(blocks, request.cpu_block_ids, strict=True))
            plan.decisions[decision.id] = len(blocks)
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
        plan = TransferPlan()
        if request.status is Status.DROPPED:
            return self._place(request, record=False), plan
        num_computed = request.num_computed
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
        placement = Placement(
            request.req_id,
            list(request.block_ids),
            request.num_computed,
            placement.num_cached_tokens,
        )
        return placement, plan

    def record_transfer(self, plan: TransferPlan, out_s: float, in_s: float) -> None:
        """The measured times of an executed plan (swap-out and swap-in parts), shared among
        its decisions by blocks moved. A plan's decisions own its swap-ins when it has any (a
        resume, a prefix load: the swap-outs beside them are demotions), else its swap-outs.
        Prefix loads' swap-in time also refits the price of loads (``Pricing.observe_load``)."""
        loads = [self._load_busy.pop(d) for d in plan.decisions if d in self._load_busy]
        if loads and plan.swap_in:
            self.pricing.observe_load(len(plan.swap_in), any(loads), in_s)
        seconds = in_s if plan.swap_in else out_s
        moved = sum(plan.decisions.values())
        for decision_id, blocks in plan.decisions.items():
            self.decisions.add_actual(decision_id, seconds * blocks / moved if moved else 0.0)

    def record_recompute(self, req_id: str, seconds: float) -> None:
        """A worker's measured time to recompute a request preempted for recompute."""
        request = self.requests.get(req_id)
        if request is None or request.decision_id is None:
            raise KVError("unknown_request", f"no preemption decision for {req_id!r}")
        self.decisions.add_actual(request.decision_id, seconds)

    # ------------------------------------------------------------------ leases and admin
    def orphan_worker(self, worker: str, now: float) -> list[str]:
        """Marks a dead worker's requests orphaned; they keep their blocks until reclaimed."""
        orphaned = [
            r for r in self.requests.values() if r.worker == worker and r.orphaned_at is None
        ]
        for request in orphaned:
            request.orphaned_at = now
        return [r.req_id for r in orphaned]

    def reclaim_orphans(self, now: float, grace_s: float) -> list[str]:
        """Frees requests orphaned for longer than ``grace_s``."""
        expired = [
            r.req_id
            for r in self.requests.values()
            if r.orphaned_at is not None and now - r.orphaned_at >= grace_s
        ]
        for req_id in expired:
            self.free(req_id, None)
        return expired

    def reset_prefix_cache(self) -> int:
        """Unregisters every cached block of both tiers (idle ones become free). Returns how
        many."""
        dropped = self.store.reset()
        for request in self.requests.values():
            if request.status is Status.RUNNING:  # its computed blocks are not offered again
                request.num_registered = request.num_computed // self.block_size
        return dropped

    def check_integrity(self) -> None:
        """Raises AssertionError unless every block is in exactly one state, ref counts equal the
        number of block-table entries naming each block, cache flags match the index, and every
        request's table fits its tokens."""
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
