"""Prefix index: chained hashes of full blocks -> the block that holds that content.

Pure Python, no torch. Each full block ``i`` of a request has a *content hash*
``c_i = sha256(c_{i-1} || tokens of block i)`` (a chain, so equal hashes mean equal prefixes) and
an *index key* ``k_i = sha256("salt" || salt || c_i)`` when the request carries a salt, else
``k_i = c_i``. Lookups match keys, so tenants with different salts never share blocks; the content
hash tells a "cached under another salt" miss apart from a plain one.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Literal

from kvstore.protocol import Tier

StopReason = Literal["no_entry", "evicted", "salt", "partial_block"]
STOP_REASONS: tuple[StopReason, ...] = ("no_entry", "evicted", "salt", "partial_block")


def content_hash(parent: bytes, tokens: list[int]) -> bytes:
    """``c_i`` from ``c_{i-1}`` and the token ids of block ``i`` (same in every process)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def index_key(content: bytes, salt: bytes | None) -> bytes:
    return content if salt is None else hashlib.sha256(b"salt" + salt + content).digest()


@dataclass
class Entry:
    """One registered block; ``position`` is its index in the chain (prefix = position + 1).
    Its content lives in the GPU block ``block``, in the CPU block ``cpu_block`` (demoted), or
    in both; never in neither."""

    block: int | None
    cpu_block: int | None
    content: bytes
    parent: bytes | None  # key of the previous block of the chain, None for the first
    position: int
    hits: int = 0

    @property
    def tier(self) -> Tier:
        return "gpu" if self.block is not None else "cpu"


@dataclass(frozen=True)
class PrefixStat:
    key: str  # hex of the key of the prefix's last block
    tokens: int
    hits: int
    block: int  # in the tier named by ``tier``
    tier: Tier


@dataclass(frozen=True)
class LookupResult:
    """The longest cached chain: per position, the GPU block and the CPU block holding it
    (either may be None, never both)."""

    gpu: list[int | None]
    cpu: list[int | None]
    stop: StopReason

    @property
    def gpu_run(self) -> int:
        """How many leading positions a GPU block holds."""
        for i, block in enumerate(self.gpu):
            if block is None:
                return i
        return len(self.gpu)


class PrefixIndex:
    """Maps keys of full, computed blocks to the GPU and/or CPU blocks holding them; counts
    queries, hits (per tier) and misses.

    Mutated only by its owner (``KVCacheManager``), which keeps ``BlockPool.cached`` and the
    ``CpuTier``'s demoted set in step with ``register``/``attach_cpu``/``detach_*``.
    """

    def __init__(self, block_size: int, evicted_memory: int = 65536) -> None:
        self.block_size = block_size
        self._by_key: dict[bytes, Entry] = {}
        self._by_block: dict[int, bytes] = {}
        self._by_cpu_block: dict[int, bytes] = {}
        self._contents: Counter[bytes] = Counter()  # content hash -> registered keys with it
        self._evicted: OrderedDict[bytes, None] = OrderedDict()
        self._evicted_memory = evicted_memory
        self.lookups = 0
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.hit_tokens_cpu = 0  # of hit_tokens, those loaded back from the CPU tier
        self.stops: Counter[str] = Counter({r: 0 for r in STOP_REASONS})

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def key_of_block(self, block: int) -> bytes | None:
        return self._by_block.get(block)

    def key_of_cpu_block(self, block: int) -> bytes | None:
        return self._by_cpu_block.get(block)

    def entry(self, key: bytes) -> Entry | None:
        """The entry of ``key`` (read it; only the index's own methods change it)."""
        return self._by_key.get(key)

    def demoted_blocks(self) -> list[int]:
        return list(self._by_cpu_block)

    def lookup(
        self,
        keys: list[bytes],
        contents: list[bytes],
        num_tokens: int,
        record: bool = True,
    ) -> LookupResult:
        """The longest cached chain, in either tier, for a request of ``num_tokens`` tokens whose
        full blocks have ``keys``/``contents``. At most ``(num_tokens - 1) // block_size`` blocks
        are reused: the last token is always computed, so the model yields logits for it. With
        ``record`` the lookup counts in the query and stop counters; the caller, which decides
        how much of the chain it uses, counts the hits (``count_hits``)."""
        limit = min(len(keys), (num_tokens - 1) // self.block_size)
        gpu: list[int | None] = []
        cpu: list[int | None] = []
        for key in keys[:limit]:
            entry = self._by_key.get(key)
            if entry is None:
                break
            gpu.append(entry.block)
            cpu.append(entry.cpu_block)
        stop = self._stop_reason(keys, contents, len(gpu), limit)
        if record:
            self.lookups += 1
            self.queried_tokens += num_tokens
            self.stops[stop] += 1
        return LookupResult(gpu, cpu, stop)

    def count_hits(self, keys: list[bytes], loaded_blocks: int) -> None:
        """A placement reused the blocks of ``keys`` (``loaded_blocks`` of them from the CPU)."""
        self.hit_tokens += len(keys) * self.block_size
        self.hit_tokens_cpu += loaded_blocks * self.block_size
        for key in keys:
            self._by_key[key].hits += 1

    def _stop_reason(
        self, keys: list[bytes], contents: list[bytes], hits: int, limit: int
    ) -> StopReason:
        if hits == limit:
            return "partial_block"
        if self._contents[contents[hits]] > 0:
            return "salt"
        if keys[hits] in self._evicted:
            return "evicted"
        return "no_entry"

    def register(
        self, block: int, key: bytes, content: bytes, parent: bytes | None, position: int
    ) -> bool:
        """Registers GPU ``block`` as holding ``key``. A key only the CPU tier holds gains the
        GPU copy. False when another GPU block holds the key (the caller keeps its duplicate
        unregistered) or the block already holds a key."""
        if block in self._by_block:
            return False
        entry = self._by_key.get(key)
        if entry is not None:
            if entry.block is not None:
                return False
            entry.block = block
        else:
            self._by_key[key] = Entry(block, None, content, parent, position)
            self._contents[content] += 1
            self._evicted.pop(key, None)
        self._by_block[block] = key
        return True

    def attach_cpu(self, key: bytes, cpu_block: int) -> None:
        """The CPU block ``cpu_block`` now holds a copy of ``key``'s GPU block."""
        entry = self._by_key[key]
        assert entry.cpu_block is None and cpu_block not in self._by_cpu_block
        entry.cpu_block = cpu_block
        self._by_cpu_block[cpu_block] = key

    def detach_gpu(self, block: int, evicted: bool) -> bool:
        """GPU ``block`` no longer holds its key. The entry lives on in the CPU tier if it has a
        copy there (True), else it is dropped (``evicted`` remembers the key to explain later
        misses)."""
        key = self._by_block.pop(block)
        entry = self._by_key[key]
        entry.block = None
        if entry.cpu_block is not None:
            return True
        self._drop(key, evicted)
        return False

    def detach_cpu(self, cpu_block: int) -> bool:
        """The CPU tier gave ``cpu_block`` away; a key held nowhere else is dropped (evicted).
        True when the entry lives on (on the GPU)."""
        key = self._by_cpu_block.pop(cpu_block)
        entry = self._by_key[key]
        entry.cpu_block = None
        if entry.block is None:
            self._drop(key, evicted=True)
            return False
        return True

    def _drop(self, key: bytes, evicted: bool) -> None:
        entry = self._by_key.pop(key)
        self._contents[entry.content] -= 1
        if self._contents[entry.content] == 0:
            del self._contents[entry.content]
        if evicted:
            self._evicted[key] = None
            if len(self._evicted) > self._evicted_memory:
                self._evicted.popitem(last=False)

    def clear(self) -> tuple[list[int], list[int]]:
        """Forgets every entry (counters stay, they are monotonic). Returns the GPU and the CPU
        blocks dropped."""
        blocks, cpu_blocks = list(self._by_block), list(self._by_cpu_block)
        self._by_key.clear()
        self._by_block.clear()
        self._by_cpu_block.clear()
        self._contents.clear()
        self._evicted.clear()
        return blocks, cpu_blocks

    def top_prefixes(self, limit: int) -> list[PrefixStat]:
        """The most reused prefixes: entries with hits, each the deepest block of its chain with
        that hit count (a 2048-token prefix hit 99 times is one row, not 128), by hits x tokens."""
        dominated: set[bytes] = set()
        for entry in self._by_key.values():
            parent = self._by_key.get(entry.parent) if entry.parent is not None else None
            if entry.hits > 0 and parent is not None and parent.hits == entry.hits:
                dominated.add(entry.parent)  # type: ignore[arg-type]
        rows = [
            PrefixStat(
                key.hex()[:16],
                (e.position + 1) * self.block_size,
                e.hits,
                e.block if e.block is not None else e.cpu_block,  # type: ignore[arg-type]
                e.tier,
            )
            for key, e in self._by_key.items()
            if e.hits > 0 and key not in dominated
        ]
        rows.sort(key=lambda r: (r.hits * r.tokens, r.tokens), reverse=True)
        return rows[:limit]

    def check_integrity(self) -> None:
        on_gpu = on_cpu = 0
        for key, entry in self._by_key.items():
            assert entry.block is not None or entry.cpu_block is not None, "an entry in no tier"
            if entry.block is not None:
                on_gpu += 1
                assert self._by_block.get(entry.block) == key, f"block {entry.block} elsewhere"
            if entry.cpu_block is not None:
                on_cpu += 1
                assert self._by_cpu_block.get(entry.cpu_block) == key, "CPU block elsewhere"
        assert on_gpu == len(self._by_block), "GPU block map has stale entries"
        assert on_cpu == len(self._by_cpu_block), "CPU block map has stale entries"
        assert sum(self._contents.values()) == len(self._by_key), "content counts drifted"
        assert self.hit_tokens_cpu <= self.hit_tokens <= self.queried_tokens
        assert sum(self.stops.values()) == self.lookups
