"""BlockStore: the blocks of both tiers and the prefix index that names their contents.

Pure Python, no torch; owned by ``KVCacheManager`` (which holds the requests). It keeps three
structures in step: the GPU ``BlockPool`` (ref counts, cached flags, LRU), the ``CpuTier``
(swapped and demoted blocks) and the ``PrefixIndex`` (which block of which tier holds a key).

The CPU tier as a second-level prefix cache (``cpu_prefix_cache``):

- **Demotion.** A cached GPU block with ref 0 is copied to a CPU block and its index entry
  names both. ``plan_write_back`` does it ahead of time for the next victims of the GPU LRU
  (the daemon runs it between calls, off the requests' critical path); a victim evicted without
  a copy is copied at eviction, in the same call (``demoted_at_eviction``), up to
  ``demote_at_eviction`` blocks until the queue is next taken (a synchronous copy the call
  waits for: past the budget a victim is dropped, counted ``over_budget`` as well). Either
  way the copy is queued in ``pending``: **the daemon runs ``pending`` before any other copy
  and before it replies**, so the GPU block's bytes are saved before its new owner can write
  it.
- **Eviction.** An evicted GPU block whose entry has a CPU copy leaves the entry in the CPU
  tier. Demoted blocks are ref-less and evicted oldest first when the CPU tier needs room;
  swapped requests always win it.
- **Promotion.** ``load`` gives CPU-only chain positions fresh GPU blocks and queues the
  CPU -> GPU copies in the returned plan; the entries then name both copies.
"""

from __future__ import annotations

from collections import Counter
from itertools import islice

from kvstore.block_pool import BlockPool, CpuTier, NoFreeBlocks
from kvstore.prefix_index import PrefixIndex
from kvstore.requests import KVError, TransferPlan

TIER_COUNTS = (
    "demoted",
    "demoted_at_eviction",
    "over_budget",
    "dropped",
    "loaded",
    "recomputed",
    "received",
)


class BlockStore:
    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        cpu_prefix_cache: bool,
        demote_at_eviction: int | None = None,
    ) -> None:
        """``demote_at_eviction``: the most victims demoted at their eviction between two
        ``take_pending`` (None: all)."""
        self.pool = BlockPool(num_gpu_blocks)
        self.cpu = CpuTier(num_cpu_blocks)
        self.index = PrefixIndex(block_size)
        self.cpu_prefix_cache = cpu_prefix_cache and num_cpu_blocks > 0
        self.pending = TransferPlan()  # demotion copies (GPU -> CPU) not yet run
        self._loading: set[int] = set()  # CPU blocks queued loads read: no demotion target
        self.demote_at_eviction = demote_at_eviction
        self._demoted_at_eviction = 0  # since the last take_pending
        self.counts: Counter[str] = Counter({name: 0 for name in TIER_COUNTS})

    # ------------------------------------------------------------------ GPU blocks
    def allocate(self, n: int) -> list[int]:
        """``n`` GPU blocks (ref 1 each), evicting cached ones oldest first. An evicted block's
        entry survives in the CPU tier when it has (or, with the tier on, gets) a copy there."""
        try:
            blocks, evicted = self.pool.allocate(n)
        except NoFreeBlocks as exc:  # callers check first; this is a guard
            raise KVError("no_space", str(exc)) from exc
        for block in evicted:
            self._evict(block)
        return blocks

    def _evict(self, block: int) -> None:
        key = self.index.key_of_block(block)
        assert key is not None, f"evicted block {block} was not in the index"
        entry = self.index.entry(key)
        assert entry is not None
        if entry.cpu_block is None and self._can_demote():
            budget = self.demote_at_eviction
            if budget is None or self._demoted_at_eviction < budget:
                self._demote(block, key)
                self._demoted_at_eviction += 1
                self.counts["demoted_at_eviction"] += 1
            else:
                self.counts["over_budget"] += 1
        if not self.index.detach_gpu(block, evicted=True):
            self.counts["dropped"] += 1

    def _can_demote(self) -> bool:
        if not self.cpu_prefix_cache:
            return False
        victim = self.cpu.next_victim()
        return self.cpu.num_free > 0 or (victim is not None and victim not in self._loading)

    def _demote(self, block: int, key: bytes) -> None:
        """Queues the copy of GPU ``block`` into a CPU block and names it in ``key``'s entry."""
        [cpu_block], evicted = self.cpu.allocate(1)
        self._forget_cpu(evicted)
        self.cpu.mark_demoted(cpu_block)
        self.index.attach_cpu(key, cpu_block)
        self.pending.swap_out.append((block, cpu_block))

    def plan_write_back(self, ahead: int, limit: int) -> int:
        """Copies to the CPU tier the cached GPU blocks among the ``ahead`` next victims of the
        GPU LRU that have no copy there yet, at most ``limit`` of them. Only free CPU blocks
        are used: a speculative copy never pushes out a prefix the GPU no longer holds. Returns
        how many were queued in ``pending``."""
        if not self.cpu_prefix_cache:
            return 0
        queued = 0
        for block in islice(self.pool.lru_iter(), ahead):
            if queued >= limit or not self.cpu.num_free:
                break
            key = self.index.key_of_block(block)
            assert key is not None
            entry = self.index.entry(key)
            if entry is not None and entry.cpu_block is None:
                self._demote(block, key)
                queued += 1
        self.counts["demoted"] += queued
        return queued

    def take_pending(self) -> TransferPlan:
        """The queued demotion copies, which the caller must run now."""
        plan, self.pending = self.pending, TransferPlan()
        self._loading = set()
        self._demoted_at_eviction = 0
        return plan

    # ------------------------------------------------------------------ CPU blocks
    def allocate_cpu(self, n: int) -> list[int]:
        """``n`` CPU blocks for a swapped request, evicting demoted prefixes if needed."""
        try:
            blocks, evicted = self.cpu.allocate(n)
        except NoFreeBlocks as exc:
            raise KVError("no_space", str(exc)) from exc
        assert not self._loading.intersection(evicted), "run take_pending() before a swap"
        self._forget_cpu(evicted)
        return blocks

    def _forget_cpu(self, evicted: list[int]) -> None:
        """Demoted blocks the CPU tier reused: their entries lose the copy (or, held nowhere
        else, are dropped)."""
        for old in evicted:
            if not self.index.detach_cpu(old):
                self.counts["dropped"] += 1

    # ------------------------------------------------------------------ prefix entries
    def load(self, keys: list[bytes], cpu_blocks: list[int], decision_id: int) -> list[int]:
        """Promotes CPU-only entries: a fresh GPU block each (ref 1, registered), and queues
        the copies of ``cpu_blocks`` into them in ``pending`` (their time goes to
        ``decision_id``). The CPU copies stay (both tiers hold the keys)."""
        self._loading.update(cpu_blocks)  # until the copies run (``take_pending``)
        blocks = self.allocate(len(keys))  # its evictions may demote: never into these
        for key, block, cpu_block in zip(keys, blocks, cpu_blocks, strict=True):
            entry = self.index.entry(key)
            assert entry is not None and entry.block is None and entry.cpu_block == cpu_block
            registered = self.register(block, key, entry.content, entry.parent, entry.position)
            assert registered, f"block {block} could not take key {key.hex()[:16]}"
            self.cpu.touch(cpu_block)
        self.pending.swap_in.extend(zip(cpu_blocks, blocks, strict=True))
        self.pending.decisions[decision_id] = len(blocks)
        self.counts["loaded"] += len(keys)
        return blocks

    def receive(self, keys: list[bytes], contents: list[bytes], positions: list[int]) -> list[int]:
        """Chain ``positions`` of ``keys``/``contents`` (none held by a GPU block here) copied in
        from another pool: a fresh GPU block each, ref 1 (the caller releases them once the
        request that wanted them holds them) and registered under its key. **The caller copies
        the bytes in before any other call**, as for ``pending``."""
        blocks = self.allocate(len(positions))
        for i, block in zip(positions, blocks, strict=True):
            parent = keys[i - 1] if i else None
            registered = self.register(block, keys[i], contents[i], parent, i)
            assert registered, f"block {block} could not take key {keys[i].hex()[:16]}"
        self.counts["received"] += len(blocks)
        return blocks

    def register(
        self, block: int, key: bytes, content: bytes, parent: bytes | None, position: int
    ) -> bool:
        """Offers a GPU block to the index; False for a duplicate, which stays unregistered."""
        if not self.index.register(block, key, content, parent, position):
            return False
        self.pool.mark_cached(block)
        return True

    def reset(self) -> int:
        """Drops every cached prefix of both tiers. Returns how many entries' blocks left."""
        blocks, cpu_blocks = self.index.clear()
        for block in blocks:
            self.pool.mark_uncached(block)
        for cpu_block in cpu_blocks:
            self.cpu.drop_demoted(cpu_block)
        return len(blocks) + len(cpu_blocks)

    def check_integrity(self, swapped: list[int]) -> None:
        """Each structure's own invariants, and that they agree (``swapped``: every CPU block
        a swapped request holds)."""
        self.pool.check_integrity()
        self.index.check_integrity()
        self.cpu.check_integrity(swapped, self.index.demoted_blocks())
        for block in range(self.pool.num_blocks):
            assert self.pool.cached[block] == (self.index.key_of_block(block) is not None), (
                f"block {block}: cache flag disagrees with the prefix index"
            )
