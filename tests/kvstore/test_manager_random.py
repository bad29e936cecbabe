"""Random admit/append/fork/free/preempt/resume/adopt/write-back sequences on tiny pools, with the
CPU prefix tier on or off.

Beside the manager the test keeps a *shadow pool*: what each GPU and CPU slot holds. It plays the
worker (writes each token into its slot, performs copy-on-write copies before its next write, as the
worker's next launch does, and confirms them later; a worker that dies never performs or confirms
its last ones) and the daemon (runs swap plans, and the demotion and load copies the manager queues,
right after each call, as the daemon does). After every step ``check_integrity()`` must pass, every
computed token of every running request must be found in its slot, and both copies of a prefix held
in two tiers must be equal: that catches a prefix hit on wrong bytes, a missing copy-on-write, a
lost swap, a demotion that copied too late, a load from the wrong CPU block or a block reused while
still held."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.cost_model import LinearCost, SwapCalibration
from kvstore.manager import KVCacheManager
from kvstore.requests import KVError, Placement, Status, TransferPlan

BS = 4
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # tiny vocab: prefixes repeat
PROMPTS = [[1] * 9, [1] * 13, [2] * 4 + [1] * 5, [2] * 4 + [0] * 9, [0, 1, 2] * 4]


class KVMachine(RuleBasedStateMachine):
    @initialize(
        gpu=st.integers(4, 12),
        cpu=st.integers(0, 12),
        swap_cost=st.sampled_from([1e-6, 1.0]),
        tier=st.booleans(),
        measured=st.booleans(),
        budget=st.sampled_from([None, 0, 1]),
    )
    def setup(
        self, gpu: int, cpu: int, swap_cost: float, tier: bool, measured: bool, budget: int | None
    ) -> None:
        self.m = KVCacheManager(gpu, cpu, BS, cpu_prefix_cache=tier, demote_at_eviction=budget)
        self.m.pricing.calibration = SwapCalibration(
            64, LinearCost(0, swap_cost), LinearCost(0, swap_cost)
        )
        for worker in ("w1", "w2"):
            recompute = [(t, c, 1e-3 + t * 1e-4 + c * 1e-6) for t in (4, 64) for c in (0, 32)]
            self.m.pricing.register(worker, [(4, 0.01), (64, 0.16)], recompute if measured else [])
        self.gpu: list[list[int | None]] = [[None] * BS for _ in range(gpu)]
        self.cpu: list[list[int | None]] = [[None] * BS for _ in range(cpu)]
        self.written: dict[str, int] = {}  # tokens the "worker" wrote, reported at its next append
        self.owed: dict[str, list[tuple[int, int]]] = {"w1": [], "w2": []}  # copies not made yet
        self.made: dict[str, list[int]] = {"w1": [], "w2": []}  # copies made, not confirmed yet
        self.next_id = 0
        self.now = 0.0

    # -------------------------------------------------------------- the worker's side
    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _poison(self, blocks: list[int]) -> None:
        for b in blocks:
            self.gpu[b] = [None] * BS

    def _perform(self, worker: str) -> None:
        """The worker's launch: the copy-on-write copies it owes, before its forward."""
        for src, dst in self.owed[worker]:
            self.gpu[dst] = list(self.gpu[src])
            self.made[worker].append(dst)
        self.owed[worker] = []

    def _write(self, req_id: str, upto: int) -> None:
        """The forward pass: KV of tokens [written, upto) lands in their slots."""
        r = self.m.requests[req_id]
        self._perform(r.worker)
        for pos in range(self.written[req_id], upto):
            self.gpu[r.block_ids[pos // BS]][pos % BS] = r.token_ids[pos]
        self.written[req_id] = upto

    def _run(self, plan: TransferPlan) -> None:
        """Runs the manager's queued copies, then ``plan`` (each: swap-outs, then swap-ins)."""
        pending = self.m.take_pending()
        for part in (pending, plan):
            self._copy(part)
            if part.swap_out or part.swap_in:  # the loads' times refit their price
                self.m.record_transfer(part, 0.0, 1e-4 + 1e-5 * len(part.swap_in))

    def _copy(self, plan: TransferPlan) -> None:
        for g, c in plan.swap_out:
            self.cpu[c] = list(self.gpu[g])
        for c, g in plan.swap_in:
            self.gpu[g] = list(self.cpu[c])

    def _placed(self, req_id: str, block_ids: list[int], num_computed: int) -> None:
        self._poison(block_ids[num_computed // BS :])  # past the prefix hit: fresh blocks
        self.written[req_id] = num_computed

    def _running(self) -> list[str]:
        return sorted(r for r, q in self.m.requests.items() if q.status is Status.RUNNING)

    def _preempted(self) -> list[str]:
        return sorted(r for r, q in self.m.requests.items() if q.status is not Status.RUNNING)

    # -------------------------------------------------------------- rules
    @rule(
        tokens=tokens_st,
        salt=st.sampled_from([None, b"s"]),
        worker=st.sampled_from(["w1", "w2"]),
        reuse=st.booleans(),
    )
    def admit(self, tokens: list[int], salt: bytes | None, worker: str, reuse: bool) -> None:
        req_id = self._new_id()
        before = self.m.pool.num_available
        try:
            placement = self.m.admit(req_id, worker, tokens, salt, reuse_prefix=reuse)
        except KVError as err:
            assert err.code == "no_space" and self.m.pool.num_available == before
            return
        self._run(TransferPlan())  # demotions of what it evicted, loads of its prefix
        assert placement.num_computed % BS == 0 and placement.num_computed < len(tokens)
        assert reuse or placement.num_computed == 0
        self._placed(req_id, placement.block_ids, placement.num_computed)

    def _append(self, req_id: str, new: list[int]) -> bool:
        """The worker's append (the O(1) path when it applies), then its copy-on-write copies.
        False when the pool has no room."""
        r = self.m.requests[req_id]
        written = self.written[req_id]
        if len(new) == 1 and not self.m.append_tokens(r.worker, [req_id], new, [written]):
            return True  # the tight decode loop took it: the same as an append changing no block
        try:
            growth = self.m.append(req_id, r.worker, new, written)
        except KVError as err:
            assert err.code == "no_space"
            return False
        self._run(TransferPlan())
        self._poison(growth.new_block_ids + [dst for _, _, dst in growth.copies])
        self.owed[r.worker] += [(src, dst) for _, src, dst in growth.copies]
        return True

    @precondition(lambda self: self._running())
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), max_size=5))
    def step(self, data: st.DataObject, new: list[int]) -> None:
        """append (reporting what was written, asking room for ``new``), then a forward pass
        (or not yet: the worker may die first)."""
        req_id = data.draw(st.sampled_from(self._running()))
        if self._append(req_id, new) and data.draw(st.booleans()):
            upto = data.draw(
                st.integers(self.written[req_id], len(self.m.requests[req_id].token_ids))
            )
            self._write(req_id, upto)

    @precondition(lambda self: self._running())
    @rule(data=st.data(), token=st.integers(0, 2))
    def fed_decode(self, data: st.DataObject, token: int) -> None:
        """The overlapped worker's decode: a sampled token, still unknown to the kvstore, is
        computed into the next slot of its table (only when the slot exists and its block is
        the request's alone: the worker feeds nothing else), then reported with its KV. The
        report fails, changing nothing, when no block is left for the slot after it (the
        worker then preempts a request and reports again)."""
        req_id = data.draw(st.sampled_from(self._running()))
        r = self.m.requests[req_id]
        self._perform(r.worker)
        position = len(r.token_ids)
        if self.written[req_id] != position or position >= len(r.block_ids) * BS:
            return
        block = r.block_ids[position // BS]
        if self.m.pool.ref_counts[block] > 1 or self.m.pool.cached[block]:
            return
        self.gpu[block][position % BS] = token
        before = (list(r.token_ids), list(r.block_ids), self.m.pool.num_available)
        try:
            growth = self.m.append(req_id, r.worker, [token], position + 1)
        except KVError as err:
            assert err.code == "no_space"
            assert (r.token_ids, r.block_ids, self.m.pool.num_available) == before
            return
        assert not growth.copies  # its block was its own
        self._run(TransferPlan())
        self._poison(growth.new_block_ids)
        self.written[req_id] = position + 1

    @precondition(lambda self: self._running())
    @rule(data=st.data(), samples=st.lists(st.integers(0, 2), min_size=2, max_size=4, unique=True))
    def fork_and_sample(self, data: st.DataObject, samples: list[int]) -> None:
        """n > 1 sampling: the prompt is computed and reported, the request forks, and every
        sequence decodes its own token into the shared last block (then one more step)."""
        parent = data.draw(st.sampled_from(self._running()))
        r = self.m.requests[parent]
        if not self._append(parent, []):
            return
        self._write(parent, len(r.token_ids))
        if not self._append(parent, []):
            return
        children = [self._new_id() for _ in samples[1:]]
        for child in children:
            self.m.fork(parent, r.worker, child)
            self.written[child] = r.num_computed
        for _ in range(2):
            for seq, token in zip([parent, *children], samples, strict=True):
                if self._append(seq, [token]):
                    self._write(seq, len(self.m.requests[seq].token_ids))

    @precondition(lambda self: self._running())
    @rule(data=st.data(), n=st.integers(1, 3))
    def fork(self, data: st.DataObject, n: int) -> None:
        parent = data.draw(st.sampled_from(self._running()))
        r = self.m.requests[parent]
        self._write(parent, self.written[parent])
        for _ in range(n):
            child = self._new_id()
            self.m.fork(parent, r.worker, child)
            self.written[child] = r.num_computed

    @precondition(lambda self: self.m.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.m.requests)))
        self.m.free(req_id, self.m.requests[req_id].worker)
        del self.written[req_id]

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        victims = data.draw(st.lists(st.sampled_from(self._running()), min_size=1, unique=True))
        by_worker: dict[str, list[str]] = {}
        for v in victims:
            by_worker.setdefault(self.m.requests[v].worker, []).append(v)
        for worker, ids in by_worker.items():
            self._perform(worker)  # the worker makes its copies before it preempts
            self.m.copied(worker, self.made[worker])
            self.made[worker] = []
            modes, plan = self.m.preempt(ids, worker, self.now)
            self._run(plan)
            assert len(plan.swap_out) == sum(
                len(self.m.requests[v].cpu_block_ids)
                for v, mode in zip(ids, modes, strict=True)
                if mode == "swap"
            )

    @precondition(lambda self: self._preempted())
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(self._preempted()))
        r = self.m.requests[req_id]
        try:
            placement, plan = self.m.resume(req_id, r.worker)
        except KVError as err:
            assert err.code == "no_space" and r.status is not Status.RUNNING
            return
        self._run(TransferPlan())  # demotions first: fresh blocks may be just-evicted ones
        swapped_in = {g for _, g in plan.swap_in}
        fresh = [
            b for b in placement.block_ids if b not in swapped_in and not self.m.pool.cached[b]
        ]
        self._poison([b for b in fresh if self.m.pool.ref_counts[b] == 1])
        self._run(plan)
        self.written[req_id] = placement.num_computed

    @precondition(lambda self: self.m.requests)
    @rule(
        data=st.data(),
        keep=st.integers(0, 6),
        reuse=st.booleans(),
        unreported=st.lists(st.integers(0, 2), max_size=3),
    )
    def worker_dies_and_another_adopts(
        self, data: st.DataObject, keep: int, reuse: bool, unreported: list[int]
    ) -> None:
        """``unreported``: tokens the dead worker streamed but never reported."""
        req_id = data.draw(st.sampled_from(sorted(self.m.requests)))
        r = self.m.requests[req_id]
        dead, heir = r.worker, "w2" if r.worker == "w1" else "w1"
        self.owed[dead], self.made[dead] = [], []  # never made, or never confirmed
        self.now += 1.0
        self.m.orphan_worker(dead, self.now)
        streamed = r.token_ids[: max(1, len(r.token_ids) - keep)] + unreported
        try:
            placement, plan = self.m.adopt(req_id, heir, streamed, reuse_prefix=reuse)
        except KVError as err:
            assert err.code in ("no_space", "too_large")  # nothing changed (integrity says)
        else:
            self._run(TransferPlan())
            if not reuse:  # it starts over, in fresh blocks
                assert placement.num_computed == 0
                self._placed(req_id, placement.block_ids, 0)
            self._run(plan)
            self.written[req_id] = placement.num_computed
            assert self.m.requests[req_id].token_ids == streamed  # it knows all the heir holds
            assert len(placement.block_ids) * BS >= len(streamed)
        for other in self.m.orphan_worker(dead, self.now):  # the rest are adopted as they are
            adopted: tuple[Placement | None, TransferPlan] = (
                self.m.adopt(other, heir, self.m.requests[other].token_ids)
                if (self.m.requests[other].status is Status.RUNNING)
                else (None, TransferPlan())
            )
            other_placement, plan = adopted
            if other_placement is not None:
                self.written[other] = other_placement.num_computed

    @rule(worker=st.sampled_from(["w1", "w2"]))
    def confirm_copies(self, worker: str) -> None:
        """The worker's next Step confirms the copies its processed steps made."""
        self.m.copied(worker, self.made[worker])
        self.made[worker] = []

    @rule()
    def reset_cache(self) -> None:
        self.m.reset_prefix_cache()

    @rule(prompt=st.sampled_from(PROMPTS), free=st.booleans())
    def serve_prompt(self, prompt: list[int], free: bool) -> None:
        """A request from a small set of prompts sharing prefixes: admitted, its prompt
        computed and reported (its blocks join the index), then freed or left running. Repeats
        make prefix hits, evictions, demotions and loads back from the CPU tier."""
        req_id = self._new_id()
        try:
            placement = self.m.admit(req_id, "w1", prompt, None)
        except KVError as err:
            assert err.code == "no_space"
            return
        self._run(TransferPlan())
        self._placed(req_id, placement.block_ids, placement.num_computed)
        self._write(req_id, len(prompt))
        if self._append(req_id, []) and free:
            self.m.free(req_id, "w1")
            del self.written[req_id]

    @rule(ahead=st.integers(0, 8), limit=st.integers(0, 4))
    def write_back(self, ahead: int, limit: int) -> None:
        """The daemon between calls: copies of the GPU LRU's next victims go to the CPU tier."""
        queued = self.m.store.plan_write_back(ahead, limit)
        assert queued <= min(ahead, limit)
        self._run(TransferPlan())

    # -------------------------------------------------------------- invariants
    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "m"):
            self.m.check_integrity()

    @invariant()
    def copies_in_both_tiers_are_equal(self) -> None:
        if not hasattr(self, "m"):
            return
        for cpu_block in self.m.index.demoted_blocks():
            key = self.m.index.key_of_cpu_block(cpu_block)
            entry = self.m.index.entry(key) if key is not None else None
            assert entry is not None
            if entry.block is not None:
                assert self.gpu[entry.block] == self.cpu[cpu_block], f"copies of {entry} differ"
            assert None not in self.cpu[cpu_block], f"demoted CPU block {cpu_block} is partial"

    @invariant()
    def computed_tokens_are_in_their_slots(self) -> None:
        if not hasattr(self, "m"):
            return
        for req_id, r in self.m.requests.items():
            if r.status is not Status.RUNNING:
                continue
            owed = {dst for _, dst in self.owed[r.worker]}
            pending = {d for w in self.owed for _, d in self.owed[w]} | {
                d for w in self.made for d in self.made[w]
            }
            for pos in range(r.num_computed):
                block = r.block_ids[pos // BS]
                if block in owed:
                    continue  # its worker makes the copy before its next forward
                if self.m.pool.is_copying(block) and block not in pending:
                    continue  # a dead worker's copy, never made: its adopter replaces it
                slot = self.gpu[block][pos % BS]
                assert slot == r.token_ids[pos], f"{req_id} pos {pos}: {slot} != {r.token_ids[pos]}"


KVMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVMachine = KVMachine.TestCase
