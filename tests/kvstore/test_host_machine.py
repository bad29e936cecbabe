"""A host of 2 or 3 pools driven through ``Host.handle`` alone: routes, admissions (with the
prefix copies between pools that ``--peer-copy`` allows), the workers' progress reports, ends,
frees, preemptions and resumes, workers leaving and coming back (their requests adopted or
freed), prefix cache resets and write-backs between calls.

Beside the host the test keeps *shadow pools*: what each GPU and CPU slot of each pool holds. It
plays the workers (each writes a token's KV into its slot before it reports it, makes its
copy-on-write copies at once and confirms them in its next step) and the devices (the movers run
the swaps, demotions and loads the services hand them; the copier runs the copies between pools,
checking that each source block holds, in its pool's prefix index, the key its destination block
is registered under). After every step: ``check_integrity()`` on every pool; every registered
block of either tier holds its key's bytes; every running request finds its computed tokens in
its slots; the host's queue per pool is the requests routed there and not yet admitted.

At an admission the test looks up the prompt in every pool first and knows what the host must
do: copy exactly the chain positions that the destination lacks and the longest run of another
pool holds in its two tiers (``always``; ``auto`` as priced; ``never`` never), each from that
pool's GPU where it holds it there, else from its CPU tier, and then the admission hits exactly
that run and what the destination holds after it.

This machine found three defects of ``Host._bring`` (kvstore/host.py), since fixed; the exact
tests of ``test_host_copies.py`` reproduce each: a copy run before the demotions its own
allocation queued, a copy that evicted the destination's own prefix, a copy of a key the
destination held past its lookup."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore import protocol as p
from kvstore.cost_model import LinearCost, SwapCalibration
from kvstore.host import Host, PeerCopyMode
from kvstore.manager import KVCacheManager
from kvstore.prefix_index import LookupResult
from kvstore.request_blocks import extend_hashes
from kvstore.requests import Request, Status, table_blocks
from kvstore.service import KVService

POLICIES: list[p.RoutingPolicy] = ["prefix", "prefix", "least_loaded", "round_robin"]
Slot = tuple[bytes | None, tuple[int, ...]] | None  # (salt, the prefix ending at the token)


def slot(salt: bytes | None, tokens: list[int], pos: int) -> Slot:
    """What the KV of token ``pos`` depends on: the salt aside, every token up to it."""
    return (salt, tuple(tokens[: pos + 1]))


def chain(tokens: list[int], salt: bytes | None, bs: int) -> tuple[list[bytes], list[bytes]]:
    request = Request("", "", salt, list(tokens))
    extend_hashes(request, bs)
    return request.keys, request.contents


class Shadow:
    """The bytes of every pool: ``gpu[pool][block]`` and ``cpu[pool][block]``, one ``Slot`` a
    token."""

    def __init__(self, pools: int, gpu: int, cpu: int, bs: int) -> None:
        self.gpu: list[list[list[Slot]]] = [[[None] * bs for _ in range(gpu)] for _ in range(pools)]
        self.cpu: list[list[list[Slot]]] = [[[None] * bs for _ in range(cpu)] for _ in range(pools)]
        self.swapped_in: set[tuple[int, int]] = set()  # (pool, GPU block) this step


class ShadowMover:
    """Pool ``pool``'s device side for its ``KVService``."""

    block_bytes = 64

    def __init__(self, shadow: Shadow, pool: int, bs: int) -> None:
        self.shadow, self.pool, self.bs = shadow, pool, bs

    def swap_out(self, pairs: list[tuple[int, int]]) -> float:
        s = self.shadow
        for g, c in pairs:
            s.cpu[self.pool][c] = list(s.gpu[self.pool][g])
        return 1e-5

    def swap_in(self, pairs: list[tuple[int, int]]) -> float:
        s = self.shadow
        for c, g in pairs:
            s.gpu[self.pool][g] = list(s.cpu[self.pool][c])
            s.swapped_in.add((self.pool, g))
        return 1e-5

    def export(self) -> p.PoolInfo:
        return p.PoolInfo("shm", [1], "float32", self.bs)


@dataclass
class Admission:
    """What the test knows before a worker admits a prompt on ``pool``: every pool's lookup,
    and per chain position the GPU block of the destination's prefix index holding it (the
    lookup stops at the first position missing, the index may hold later ones)."""

    pool: int
    keys: list[bytes]
    hits: list[LookupResult]
    held: list[int | None]  # per position below the lookup's limit
    entries: list[bool]  # per position: the destination's index has it, in either tier
    room: int  # the host's count: available blocks less the watermark
    idle_own: int  # of them, blocks of the destination's own GPU run (ref 0)
    needed: int  # blocks the admission takes beyond the destination's GPU run
    copies: list[tuple[int, int, list[tuple[int, int]], p.Tier]] = field(default_factory=list)
    copied: dict[int, p.Tier] = field(default_factory=dict)  # chain position -> source tier
    own_evicted: bool = False  # a receive evicted a block of the destination's own chain

    @property
    def here(self) -> LookupResult:
        return self.hits[self.pool]

    @property
    def best(self) -> int:
        """The longest run another pool holds in its two tiers."""
        return max(len(h.gpu) for i, h in enumerate(self.hits) if i != self.pool)

    def positions(self) -> list[int]:
        """What a copy brings: the positions of the best run no GPU block here holds."""
        return [i for i in range(self.here.gpu_run, self.best) if self.held[i] is None]

    def after(self, start: int) -> tuple[int, int]:
        """The chain the destination holds from ``start`` on: (on its GPU, in either tier)."""
        gpu = start
        while gpu < len(self.held) and self.held[gpu] is not None:
            gpu += 1
        either = start
        while either < len(self.entries) and self.entries[either]:
            either += 1
        return gpu, either


class HostMachine(RuleBasedStateMachine):
    MODE: PeerCopyMode = "always"

    @initialize(
        pools=st.integers(2, 3),
        gpu=st.integers(6, 16),
        cpu=st.integers(0, 8),
        bs=st.sampled_from([4, 16]),
        tier=st.booleans(),
        calibrated=st.booleans(),
        profile=st.booleans(),
        copy_s=st.sampled_from([1e-9, 1.0]),
        budget=st.sampled_from([None, 0, 1]),
    )
    def setup(
        self,
        pools: int,
        gpu: int,
        cpu: int,
        bs: int,
        tier: bool,
        calibrated: bool,
        profile: bool,
        copy_s: float,
        budget: int | None,
    ) -> None:
        self.bs = bs
        self.now = 0.0
        self.shadow = Shadow(pools, gpu, cpu, bs)
        services = []
        for i in range(pools):
            m = KVCacheManager(gpu, cpu, bs, cpu_prefix_cache=tier, demote_at_eviction=budget)
            if calibrated:
                m.pricing.calibration = SwapCalibration(
                    64, LinearCost(0, 1e-6), LinearCost(0, 1e-6)
                )
            mover = ShadowMover(self.shadow, i, bs)
            services.append(KVService(m, mover, 60, 60, self.clock, write_back_ahead=4))
        self.host = Host(
            services,
            [f"cpu:{i}" for i in range(pools)],
            self.copier,
            LinearCost(copy_s, copy_s),
            self.MODE,
            self.clock,
        )
        # a cheap recompute (or none measured: the copy wins) against a cheap or dear copy
        self.profile = [(bs, 1e-4), (8 * bs, 8e-4)] if profile else []
        self.workers = [f"w{i}" for i in range(pools)]
        self.alive = [True] * pools
        for i in range(pools):
            self.register(i)
        self.unconfirmed: dict[str, list[int]] = {w: [] for w in self.workers}
        self.routed: dict[str, tuple[int, int]] = {}  # req id -> (pool, tokens owed)
        self.waiting: dict[str, tuple[list[int], bytes | None]] = {}  # routed, not admitted
        self.chains: dict[bytes, tuple[bytes | None, list[int]]] = {}  # key -> its prefix
        self.admission: Admission | None = None
        self.next_id = 0

    # -------------------------------------------------------------- the devices
    def clock(self) -> float:
        return self.now

    def copier(self, src: int, dst: int, pairs: list[tuple[int, int]], tier: p.Tier) -> float:
        """The copy between pools, checked against what the test knew before the step: each
        source block holds its key (in ``tier``; from the CPU tier only what the source's GPU
        does not hold) and its bytes."""
        a = self.admission
        assert a is not None and self.MODE != "never", "a copy outside an admission"
        assert dst == a.pool and src != dst and pairs
        assert len(a.hits[src].gpu) == a.best, "the copy's source is not the longest run"
        assert all(tier != t for _, _, _, t in a.copies), "two copies from one tier"
        m_src, m_dst = self.host.managers[src], self.host.managers[dst]
        on_cpu = {b for b in a.hits[src].cpu if b is not None}
        for s, d in pairs:
            key = m_dst.index.key_of_block(d)
            if tier == "gpu":
                assert key is not None and m_src.index.key_of_block(s) == key, (s, d)
                assert self.shadow.gpu[src][s] == self.expected(key), f"source block {s} bytes"
            else:
                assert s in on_cpu, f"CPU block {s} is not in the source's lookup"
                assert key is not None and m_src.index.key_of_cpu_block(s) == key, (s, d)
                assert self.shadow.cpu[src][s] == self.expected(key), f"source CPU {s} bytes"
            assert m_dst.pool.ref_counts[d] == 1, f"received block {d} is not fresh"
            assert a.keys.index(key) not in a.copied, f"position {a.keys.index(key)} copied twice"
            a.copied[a.keys.index(key)] = tier
        source = self.shadow.gpu[src] if tier == "gpu" else self.shadow.cpu[src]
        for s, d in pairs:
            self.shadow.gpu[dst][d] = list(source[s])
        for i, block in enumerate(a.held):
            if block is not None and m_dst.index.key_of_block(block) != a.keys[i]:
                a.own_evicted = True
        a.copies.append((src, dst, list(pairs), tier))
        return 1e-5

    def expected(self, key: bytes) -> list[Slot]:
        salt, prefix = self.chains[key]
        return [slot(salt, prefix, pos) for pos in range(len(prefix) - self.bs, len(prefix))]

    # -------------------------------------------------------------- the workers
    def register(self, pool: int) -> None:
        reply = self.host.handle(p.Register(self.workers[pool], self.profile, pool=pool))
        assert isinstance(reply, p.Registered)
        self.alive[pool] = True

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _know(self, tokens: list[int], salt: bytes | None) -> list[bytes]:
        keys, _ = chain(tokens, salt, self.bs)
        for i, key in enumerate(keys):
            self.chains.setdefault(key, (salt, tokens[: (i + 1) * self.bs]))
        return keys

    def step(self, pool: int, body: p.Step) -> p.StepReply:
        """A worker's step: its copy-on-write copies confirmed, then what the step changed in
        its tables applied to the shadow (fresh blocks hold nothing yet)."""
        worker = self.workers[pool]
        body = msgspec.structs.replace(body, copied=self.unconfirmed[worker])
        self.unconfirmed[worker] = []
        self.shadow.swapped_in = set()
        reply = self.host.handle(body)
        assert isinstance(reply, p.StepReply), reply
        for placed in reply.admitted:
            self.routed.pop(placed.req_id, None)
            self.waiting.pop(placed.req_id, None)
        for placed in [*reply.admitted, *reply.resumed]:
            self._placed(pool, placed)
        for grown in reply.appended:
            for block in grown.new_block_ids:
                self.shadow.gpu[pool][block] = [None] * self.bs
            for _, src, dst in grown.copies:  # made before the next forward: now
                self.shadow.gpu[pool][dst] = list(self.shadow.gpu[pool][src])
                self.unconfirmed[worker].append(dst)
        return reply

    def _placed(self, pool: int, placed: p.Placed) -> None:
        """Blocks past the computed tokens hold nothing the request may read: poisoned, unless
        shared, cached or just swapped in."""
        m = self.host.managers[pool]
        for i, block in enumerate(placed.block_ids):
            fresh = m.pool.ref_counts[block] == 1 and not m.pool.cached[block]
            loaded = (pool, block) in self.shadow.swapped_in
            if i * self.bs >= placed.num_computed and fresh and not loaded:
                self.shadow.gpu[pool][block] = [None] * self.bs
        self._check_computed(pool, placed.req_id)

    def _check_computed(self, pool: int, req_id: str) -> None:
        r = self.host.managers[pool].requests[req_id]
        for pos in range(r.num_computed):
            got = self.shadow.gpu[pool][r.block_ids[pos // self.bs]][pos % self.bs]
            assert got == slot(r.salt, r.token_ids, pos), f"{req_id} pos {pos} on pool {pool}"

    def _write(self, pool: int, req_id: str, upto: int) -> None:
        """The worker's forward: the KV of its tokens up to ``upto`` lands in their slots."""
        r = self.host.managers[pool].requests[req_id]
        m = self.host.managers[pool]
        for pos in range(r.num_computed, upto):
            block = r.block_ids[pos // self.bs]
            assert m.pool.ref_counts[block] == 1 and not m.pool.cached[block], (
                f"{req_id} would write into shared or registered block {block}"
            )
            self.shadow.gpu[pool][block][pos % self.bs] = slot(r.salt, r.token_ids, pos)

    def _requests(self, running: bool | None = None) -> list[tuple[int, str]]:
        """(pool, req id) of the live workers' requests, running or preempted or either."""
        out = []
        for i, m in enumerate(self.host.managers):
            if not self.alive[i]:
                continue
            for req_id, r in m.requests.items():
                if running is None or (r.status is Status.RUNNING) == running:
                    out.append((i, req_id))
        return sorted(out)

    def _running(self) -> list[tuple[int, str]]:
        return self._requests(True)

    def _preempted(self) -> list[tuple[int, str]]:
        return self._requests(False)

    def _lookups(self, tokens: list[int], salt: bytes | None) -> list[LookupResult]:
        keys, contents = chain(tokens, salt, self.bs)
        return [
            m.index.lookup(keys, contents, len(tokens), record=False) for m in self.host.managers
        ]

    # -------------------------------------------------------------- rules
    def prompt(self, data: st.DataObject) -> tuple[list[int], bytes | None]:
        bs = self.bs
        prefixes = [[], [1] * 2 * bs, [1] * bs + [2] * bs, [1] * bs + [2] * bs + [3] * bs]
        prefix = data.draw(st.sampled_from(prefixes), label="prefix")
        suffix = data.draw(st.lists(st.integers(0, 3), max_size=bs + 2), label="suffix")
        salt = data.draw(st.sampled_from([None, None, None, b"s"]), label="salt")
        return (prefix + suffix) or [0], salt

    @rule(data=st.data(), policy=st.sampled_from(POLICIES))
    def route(self, data: st.DataObject, policy: p.RoutingPolicy) -> None:
        tokens, salt = self.prompt(data)
        req_id = self._new_id()
        self._know(tokens, salt)
        found = self._lookups(tokens, salt)
        runs, helds = [h.gpu_run for h in found], [len(h.gpu) for h in found]
        lookups = [m.index.lookups for m in self.host.managers]
        reply = self.host.handle(p.Route([p.RouteItem(req_id, tokens, salt)], policy))
        assert isinstance(reply, p.Routed)
        [item] = reply.items
        assert [m.index.lookups for m in self.host.managers] == lookups, "routing counted"
        assert 0 <= item.pool < len(runs)
        bs, here, best, held = self.bs, runs[item.pool], max(runs), max(helds)
        expected = {
            "cached": (here * bs, here == best == held > 0),
            "none": (0, held == 0),
            "copy": (best * bs, here < best),
            "load": (held * bs, best < held),
            "recompute": (here * bs, here < held),
        }
        cached, consistent = expected[item.bring]
        assert consistent and item.cached_tokens == cached, (item, runs, helds)
        assert len(item.predicted_s) == (0 if policy == "round_robin" else len(runs))
        if policy != "round_robin" and any(self.alive):
            assert self.alive[item.pool], "routed to a pool without a live worker"
        self.routed[req_id] = (item.pool, len(tokens) - item.cached_tokens)
        self.waiting[req_id] = (tokens, salt)

    def _live(self) -> list[int]:
        return [i for i, up in enumerate(self.alive) if up]

    @precondition(lambda self: any(self.alive))
    @rule(data=st.data(), reuse=st.sampled_from([True, True, True, False]))
    def admit(self, data: st.DataObject, reuse: bool) -> None:
        """A worker admits a routed request (mostly on its pool) or a fresh prompt."""
        routed = data.draw(st.booleans(), label="routed") if self.waiting else False
        if routed:
            req_id = data.draw(st.sampled_from(sorted(self.waiting)), label="req")
            tokens, salt = self.waiting[req_id]
            pool = self.routed[req_id][0]
            if not self.alive[pool] or data.draw(st.integers(0, 3), label="elsewhere") == 0:
                pool = data.draw(st.sampled_from(self._live()), label="pool")
        else:
            req_id, (tokens, salt) = self._new_id(), self.prompt(data)
            pool = data.draw(st.sampled_from(self._live()), label="pool")
        self._admit(pool, req_id, tokens, salt, reuse)

    @precondition(lambda self: any(self.alive))
    @rule(data=st.data(), keep=st.booleans())
    def serve(self, data: st.DataObject, keep: bool) -> None:
        """A prompt admitted, computed and reported in full (its blocks join the pool's prefix
        index), then ended, or left running: what later admissions elsewhere copy."""
        tokens, salt = self.prompt(data)
        pool = data.draw(st.sampled_from(self._live()), label="pool")
        self._serve(pool, tokens, salt, keep)

    @precondition(lambda self: any(self.alive))
    @rule(data=st.data())
    def flood(self, data: st.DataObject) -> None:
        """A prompt of fresh tokens as long as a pool has room for, served and ended: it evicts
        the pool's cached prefixes (into its CPU tier, where it has one), which admissions on
        the other pools then load from there."""
        pool = data.draw(st.sampled_from(self._live()), label="pool")
        m = self.host.managers[pool]
        room = m.pool.num_available - m.watermark_blocks
        if room >= 2:
            self._serve(pool, [4 + self.next_id % 64] * ((room - 1) * self.bs), None, False)

    def _serve(self, pool: int, tokens: list[int], salt: bytes | None, keep: bool) -> None:
        req_id = self._new_id()
        if not self._admit(pool, req_id, tokens, salt, True):
            return
        self._write(pool, req_id, len(tokens))
        final = p.AppendItem(req_id, [], len(tokens))
        body = p.Step(self.workers[pool], appends=[final])
        if not keep:
            body = p.Step(self.workers[pool], finals=[final], frees=[req_id])
        assert not self.step(pool, body).errors

    def _admit(
        self, pool: int, req_id: str, tokens: list[int], salt: bytes | None, reuse: bool
    ) -> bool:
        """Admits a prompt on ``pool``, checking what the host copied and what it hit against
        every pool's lookup before; True when admitted."""
        keys = self._know(tokens, salt)
        m = self.host.managers[pool]
        hits = self._lookups(tokens, salt)
        here = hits[pool]
        run = [b for b in here.gpu[: here.gpu_run] if b is not None]
        idle_own = sum(1 for b in run if m.pool.ref_counts[b] == 0)
        room = m.pool.num_available - m.watermark_blocks
        needed = table_blocks(len(tokens), self.bs) - here.gpu_run
        limit = min(len(keys), (len(tokens) - 1) // self.bs)
        entries = [m.index.entry(key) for key in keys[:limit]]
        held = [e.block if e is not None else None for e in entries]
        present = [e is not None for e in entries]
        a = Admission(pool, keys, hits, held, present, room, idle_own, needed)
        self.admission = a
        try:
            item = p.AdmitItem(req_id, tokens, salt, reuse_prefix=reuse)
            reply = self.step(pool, p.Step(self.workers[pool], admits=[item]))
        finally:
            self.admission = None
        self._check_admission(a, reuse, reply)
        for _, _, pairs, _ in a.copies:  # held by the request or cached, never free
            for _, d in pairs:
                assert m.pool.ref_counts[d] > 0 or m.pool.cached[d], f"received {d} is free"
        event(f"admission: {'copied' if a.copies else 'no copy'}{', refused' * bool(reply.errors)}")
        assert not a.own_evicted, "a copy evicted the destination's own prefix"
        return not reply.errors

    def _check_admission(self, a: Admission, reuse: bool, reply: p.StepReply) -> None:
        bs, here = self.bs, a.here
        copyable = reuse and a.best > len(here.gpu)
        if a.copies:
            assert copyable and a.room >= a.needed and len({c[0] for c in a.copies}) == 1
            src = a.copies[0][0]
            assert sorted(a.copied) == a.positions(), "the copy is not the missing positions"
            event(f"copied from the source's {'+'.join(sorted(set(a.copied.values())))}")
            for i, tier in a.copied.items():  # a block on the source's GPU comes from there
                assert tier == ("gpu" if a.hits[src].gpu[i] is not None else "cpu"), (i, tier)
        elif self.MODE == "always" and copyable:  # only for want of room
            assert a.room - a.idle_own < a.needed, "no copy, though --peer-copy always"
        if reply.errors:
            [error] = reply.errors
            assert error.code == "no_space", error
            assert not a.copies, "a copy made for an admission that had no room"
            return
        [placed] = reply.admitted
        assert placed.num_computed == placed.num_cached_tokens and placed.num_computed % bs == 0
        computed = placed.num_computed // bs
        if not reuse:
            assert computed == 0
        elif a.copies:  # the copied run, and what the destination holds after it
            gpu, either = a.after(a.best)
            assert computed in (gpu, either), (placed, a)
        else:  # its GPU run, or with the chain going on in the CPU tier, loaded
            assert computed in (here.gpu_run, len(here.gpu)), (placed, a)

    @precondition(lambda self: self._running())
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), max_size=2))
    def compute(self, data: st.DataObject, new: list[int]) -> None:
        """The worker computes some of a request's tokens, reports them and asks room for
        ``new`` sampled ones."""
        pool, req_id = data.draw(st.sampled_from(self._running()), label="req")
        r = self.host.managers[pool].requests[req_id]
        upto = data.draw(st.integers(r.num_computed, len(r.token_ids)), label="upto")
        self._write(pool, req_id, upto)
        item = p.AppendItem(req_id, new, upto)
        reply = self.step(pool, p.Step(self.workers[pool], appends=[item]))
        assert all(e.code == "no_space" for e in reply.errors), reply.errors
        if not reply.errors:
            self._know(r.token_ids, r.salt)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A request ends: its last progress (its blocks join the index), then freed."""
        pool, req_id = data.draw(st.sampled_from(self._running()), label="req")
        r = self.host.managers[pool].requests[req_id]
        upto = data.draw(st.integers(r.num_computed, len(r.token_ids)), label="upto")
        self._write(pool, req_id, upto)
        final = p.AppendItem(req_id, [], upto)
        reply = self.step(pool, p.Step(self.workers[pool], finals=[final], frees=[req_id]))
        assert not reply.errors, reply.errors
        assert req_id not in self.host.managers[pool].requests

    @precondition(lambda self: self._requests())
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        pool, req_id = data.draw(st.sampled_from(self._requests()), label="req")
        reply = self.step(pool, p.Step(self.workers[pool], frees=[req_id]))
        assert not reply.errors, reply.errors

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        pool, req_id = data.draw(st.sampled_from(self._running()), label="req")
        reply = self.step(pool, p.Step(self.workers[pool], preempts=[req_id]))
        assert not reply.errors and [r for r, _ in reply.preempted] == [req_id], reply

    @precondition(lambda self: self._preempted())
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        pool, req_id = data.draw(st.sampled_from(self._preempted()), label="req")
        reply = self.step(pool, p.Step(self.workers[pool], resumes=[req_id]))
        assert all(e.code == "no_space" for e in reply.errors), reply.errors

    @precondition(lambda self: sum(self.alive) > 1)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        """A worker unregisters: its requests are orphaned, its steps refused."""
        pool = data.draw(st.sampled_from(self._live()), label="pool")
        worker = self.workers[pool]
        assert self.host.handle(p.Unregister(worker)) == p.Ack()
        self.alive[pool] = False
        self.unconfirmed[worker] = []  # never confirmed: the adopter does not trust them
        reply = self.host.handle(p.Step(worker))
        assert isinstance(reply, p.Error) and reply.code == "unknown_worker"

    @rule(data=st.data())
    def come_back(self, data: st.DataObject) -> None:
        """A worker registers (again, or restarted without a goodbye): what the host holds of
        it is orphaned, and it adopts each request or frees it."""
        pool = data.draw(st.integers(0, len(self.workers) - 1), label="pool")
        self.register(pool)
        worker, m = self.workers[pool], self.host.managers[pool]
        self.unconfirmed[worker] = []
        for req_id in sorted(m.requests):
            r = m.requests[req_id]
            assert r.orphaned_at is not None
            item = p.AdmitItem(req_id, list(r.token_ids), r.salt, adopt=True)
            if data.draw(st.booleans(), label="adopt"):
                reply = self.step(pool, p.Step(worker, admits=[item]))
                if not reply.errors:
                    continue
                assert reply.errors[0].code == "no_space", reply.errors
            assert not self.step(pool, p.Step(worker, frees=[req_id])).errors

    @rule()
    def between_calls(self) -> None:
        self.shadow.swapped_in = set()
        self.host.between_calls()

    @rule()
    def reset_cache(self) -> None:
        assert isinstance(self.host.handle(p.ResetCache()), p.CacheReset)

    # -------------------------------------------------------------- invariants
    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "host"):
            return
        for m in self.host.managers:
            m.check_integrity()

    @invariant()
    def registered_blocks_hold_their_keys(self) -> None:
        if not hasattr(self, "host"):
            return
        for i, m in enumerate(self.host.managers):
            for block in range(m.pool.num_blocks):
                key = m.index.key_of_block(block)
                if key is not None:
                    assert self.shadow.gpu[i][block] == self.expected(key), (i, block)
            for cpu_block in m.index.demoted_blocks():
                key = m.index.key_of_cpu_block(cpu_block)
                assert key is not None
                assert self.shadow.cpu[i][cpu_block] == self.expected(key), (i, cpu_block)

    @invariant()
    def running_requests_find_their_computed_tokens(self) -> None:
        if not hasattr(self, "host"):
            return
        for i, m in enumerate(self.host.managers):
            for req_id, r in m.requests.items():
                if r.status is Status.RUNNING:
                    self._check_computed(i, req_id)

    @invariant()
    def the_host_counts_what_was_routed_and_not_admitted(self) -> None:
        if not hasattr(self, "host"):
            return
        stats = self.host.handle(p.GetStats())
        assert isinstance(stats, p.Stats)
        for i, row in enumerate(stats.pools):
            mine = [owed for pool, owed in self.routed.values() if pool == i]
            assert (row.queued, row.queued_tokens) == (len(mine), sum(mine)), (i, row)
            gpu = row.gpu
            assert gpu.free + gpu.used + gpu.cached == gpu.total, (i, gpu)
            assert row.workers == ([self.workers[i]] if self.alive[i] else [])


settings_ = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class AlwaysMachine(HostMachine):
    MODE = "always"


class AutoMachine(HostMachine):
    MODE = "auto"


class NeverMachine(HostMachine):
    MODE = "never"


AlwaysMachine.TestCase.settings = settings_
AutoMachine.TestCase.settings = settings_
NeverMachine.TestCase.settings = settings_
TestAlways = AlwaysMachine.TestCase
TestAuto = AutoMachine.TestCase
TestNever = NeverMachine.TestCase
