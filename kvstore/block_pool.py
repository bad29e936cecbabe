"""Block pools: which block ids are free, in use (ref count > 0) or cached (ref 0, still hashed),
for the GPU (``BlockPool``) and the CPU tier (``CpuTier``).

Pure Python, no torch. A ``BlockPool`` only tracks ids; the bytes live in the pool tensor that
``kvstore.device`` owns. States of a block, exactly one at a time:

- free:   ref 0, holds nothing reusable; in the free queue.
- used:   ref > 0; held by one or more requests.
- cached: ref 0, but its content is registered in the prefix index; in the LRU, evicted (oldest
          first) only when the free queue is empty.

A used block may also be *copying*: the destination of a copy-on-write copy that the worker
performs on its own stream and has not confirmed yet. Its content is not trusted until then (a
worker that dies first never makes the copy): it is never registered, and a request that holds
it computes it again when another worker takes it over or when it is swapped. A confirmation
names only the block, and may come after the block was freed and taken again for another copy:
that late one confirms the copy it was made for, not the block's next (``copied``).
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, deque
from collections.abc import Collection, Iterator


class NoFreeBlocks(Exception):
    """Raised when an allocation asks for more blocks than are free or evictable."""


class _Tier:
    """What the GPU pool and the CPU tier count alike: ``num_blocks`` ids, the free ones and the
    evictable ones (an LRU: cached GPU blocks, demoted CPU blocks), the rest held by requests."""

    num_blocks: int
    _free: Collection[int]
    _lru: OrderedDict[int, None]  # first = next victim

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free plus evictable."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks requests hold (on the CPU: swapped requests)."""
        return self.num_blocks - self.num_available

    def lru_order(self) -> list[int]:
        """Evictable blocks, next victim first."""
        return list(self._lru)


class BlockPool(_Tier):
    """Ref counts, a FIFO free queue and an LRU of cached blocks for ``num_blocks`` ids.

    The caller (``KVCacheManager``) decides which blocks are cached: ``mark_cached`` when it
    registers a block in the prefix index, ``mark_uncached`` when it unregisters one. ``allocate``
    returns the cached blocks it evicted so the caller can drop them from the index.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.cached = [False] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # first = least recently used
        # used blocks whose copy-on-write is not confirmed -> the worker that owes the
        # confirmation (None: a dead one, it never comes)
        self._copying: dict[int, str | None] = {}
        # (worker, block): confirmations still due for copies into blocks freed since
        self._late: Counter[tuple[str, int]] = Counter()

    @property
    def num_cached_free(self) -> int:
        """Cached blocks with ref 0 (evictable)."""
        return len(self._lru)

    def lru_iter(self) -> Iterator[int]:
        """Evictable blocks, next victim first, lazily (do not change the pool meanwhile)."""
        return iter(self._lru)

    def allocate(self, n: int) -> tuple[list[int], list[int]]:
        """Takes ``n`` blocks (ref 1 each): free ones first, then the least recently used cached.

        Returns ``(blocks, evicted)``; ``evicted`` are the cached blocks that were reused, now
        uncached: the caller must drop them from its prefix index. All or nothing.
        """
        if n > self.num_available:
            raise NoFreeBlocks(f"need {n} blocks, {self.num_available} available")
        blocks: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._lru.popitem(last=False)
                self.cached[block] = False
                evicted.append(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks, evicted

    def ref(self, block: int) -> None:
        """Adds a holder to ``block``; a cached block with ref 0 leaves the LRU."""
        if self.ref_counts[block] == 0:
            if not self.cached[block]:
                raise ValueError(f"block {block} is free; only used or cached blocks can be shared")
            del self._lru[block]
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drops one holder from each block. At ref 0 a cached block becomes the most recently
        used entry of the LRU and an uncached one returns to the free queue's tail."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise ValueError(f"double free of block {block}")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if (owner := self._copying.pop(block, None)) is not None:
                    self._late[owner, block] += 1  # it must not confirm the block's next copy
                if self.cached[block]:
                    self._lru[block] = None
                else:
                    self._free.append(block)

    def mark_copying(self, block: int, worker: str) -> None:
        """A copy-on-write copy into ``block`` (used, uncached) is due from ``worker``: its
        content is not trusted until ``copied``."""
        if self.ref_counts[block] == 0 or self.cached[block]:
            raise ValueError(f"block {block} is not a private block in use")
        self._copying[block] = worker

    def copied(self, worker: str, blocks: list[int]) -> None:
        """``worker`` performed the copies into ``blocks``, in the order it was asked for them.
        One into a block freed before this confirmation came was an earlier copy than the one
        the block may be copying now (a worker confirms in order): it confirms nothing more.
        Blocks not copying for ``worker`` are ignored."""
        for block in blocks:
            if self._late[worker, block]:
                self._late[worker, block] -= 1
                if not self._late[worker, block]:
                    del self._late[worker, block]
            elif self._copying.get(block) == worker:
                del self._copying[block]

    def forget_worker(self, worker: str) -> None:
        """``worker`` died: the confirmations it owed never come (its copies stay untrusted)."""
        for key in [key for key in self._late if key[0] == worker]:
            del self._late[key]
        for block, owner in self._copying.items():
            if owner == worker:
                self._copying[block] = None

    def is_copying(self, block: int) -> bool:
        return block in self._copying

    @property
    def num_copying(self) -> int:
        return len(self._copying)

    def mark_cached(self, block: int) -> None:
        """The block's content is now registered in the prefix index (the block must be used)."""
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is not in use")
        self.cached[block] = True

    def mark_uncached(self, block: int) -> None:
        """The block left the prefix index; if nobody holds it, it becomes free."""
        if not self.cached[block]:
            return
        self.cached[block] = False
        if self.ref_counts[block] == 0:
            del self._lru[block]
            self._free.append(block)

    def check_integrity(self) -> None:
        """Every block in exactly one state; counts add up to the total."""
        free = set(self._free)
        lru = set(self._lru)
        assert len(free) == len(self._free), "a block is twice in the free queue"
        assert not free & lru, f"blocks both free and cached: {sorted(free & lru)}"
        for block in range(self.num_blocks):
            ref = self.ref_counts[block]
            assert ref >= 0, f"block {block} has negative ref count {ref}"
            if ref > 0:
                assert block not in free and block not in lru, f"used block {block} is listed free"
            elif self.cached[block]:
                assert block in lru, f"cached block {block} with ref 0 is not in the LRU"
            else:
                assert block in free, f"free block {block} is missing from the free queue"
        assert self.num_free + self.num_cached_free + self.num_used == self.num_blocks
        for block in self._copying:
            assert self.ref_counts[block] > 0, f"copying block {block} is not in use"
            assert not self.cached[block], f"copying block {block} is in the prefix index"
        assert all(n > 0 for n in self._late.values()), "a late confirmation counted down past 0"


class CpuTier(_Tier):
    """The CPU tier's block ids (the bytes live in the pinned host pool ``kvstore.device`` owns).

    States of a CPU block, exactly one at a time:

    - free:    in the free set;
    - swapped: owned by one preempted request (``allocate`` returned it; ``release`` frees it);
    - demoted: holds a copy of a cached prefix block (``mark_demoted``), ref-less, in an LRU.
      Swapped requests always win space: ``allocate`` takes free ids first, then evicts demoted
      blocks oldest first and returns them so that the caller drops them from its prefix index.

    Free ids are taken lowest first so that a swap's blocks tend to form contiguous runs, which
    the device copies in one transfer each.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: set[int] = set(range(num_blocks))
        self._heap: list[int] = list(range(num_blocks))  # the same ids, lowest first
        self._lru: OrderedDict[int, None] = OrderedDict()  # demoted; first = next victim

    @property
    def num_demoted(self) -> int:
        return len(self._lru)

    def is_demoted(self, block: int) -> bool:
        return block in self._lru

    def next_victim(self) -> int | None:
        """The demoted block the next allocation without free blocks would take."""
        return next(iter(self._lru), None)

    def allocate(self, n: int) -> tuple[list[int], list[int]]:
        """Takes ``n`` blocks: free ones (lowest first), then the oldest demoted ones. Returns
        ``(blocks, evicted)``: ``evicted`` held demoted prefixes, which the caller must drop
        from its index. All or nothing."""
        if n > self.num_available:
            raise NoFreeBlocks(f"need {n} CPU blocks, {self.num_available} available")
        take = min(n, len(self._free))
        blocks = [heapq.heappop(self._heap) for _ in range(take)]
        self._free.difference_update(blocks)
        evicted = [self._lru.popitem(last=False)[0] for _ in range(n - take)]
        return blocks + evicted, evicted

    def release(self, blocks: list[int]) -> None:
        """Frees blocks a swapped request held."""
        for block in blocks:
            if block in self._free or block in self._lru or not 0 <= block < self.num_blocks:
                raise ValueError(f"double free of CPU block {block}")
            self._free.add(block)
            heapq.heappush(self._heap, block)

    def mark_demoted(self, block: int) -> None:
        """An allocated block now holds a demoted prefix copy: it joins the LRU's young end."""
        if block in self._free or block in self._lru:
            raise ValueError(f"CPU block {block} is not allocated")
        self._lru[block] = None

    def touch(self, block: int) -> None:
        """A demoted block was hit: it becomes the youngest."""
        self._lru.move_to_end(block)

    def drop_demoted(self, block: int) -> None:
        """A demoted block's prefix left the index: the block is free again."""
        del self._lru[block]
        self._free.add(block)
        heapq.heappush(self._heap, block)

    def check_integrity(self, swapped: list[int], demoted: list[int]) -> None:
        """``swapped``: every CPU block some swapped request holds, per the manager;
        ``demoted``: every CPU block the prefix index names."""
        assert len(swapped) == len(set(swapped)), "a CPU block is held twice"
        assert not set(swapped) & self._free, "a held CPU block is also free"
        assert not set(swapped) & set(self._lru), "a held CPU block is also demoted"
        assert sorted(demoted) == sorted(self._lru), "demoted blocks and the index disagree"
        assert not self._free & set(self._lru), "a CPU block is both free and demoted"
        total = len(swapped) + len(self._free) + len(self._lru)
        assert total == self.num_blocks, "CPU blocks leaked"
        assert sorted(self._heap) == sorted(self._free), "CPU free heap out of sync"
