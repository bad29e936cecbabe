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
    """One registered block; ``position`` is its index in the chain (prefix = position + 1)."""

    block: int
    content: bytes
    parent: bytes | None  # key of the previous block of the chain, None for the first
    position: int
    hits: int = 0


@dataclass(frozen=True)
class PrefixStat:
    key: str  # hex of the key of the prefix's last block
    tokens: int
    hits: int
    block: int
    tier: Tier


@dataclass(frozen=True)
class LookupResult:
    blocks: list[int]
    stop: StopReason


class PrefixIndex:
    """Maps keys of full, computed blocks to GPU block ids; counts queries, hits and misses.

    Mutated only by its owner (``KVCacheManager``), which keeps ``BlockPool.cached`` in step with
    ``register``/``remove_block``.
    """

    def __init__(self, block_size: int, evicted_memory: int = 65536) -> None:
        self.block_size = block_size
        self._by_key: dict[bytes, Entry] = {}
        self._by_block: dict[int, bytes] = {}
        self._contents: Counter[bytes] = Counter()  # content hash -> registered keys with it
        self._evicted: OrderedDict[bytes, None] = OrderedDict()
        self._evicted_memory = evicted_memory
        self.lookups = 0
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.stops: Counter[str] = Counter({r: 0 for r in STOP_REASONS})

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def key_of_block(self, block: int) -> bytes | None:
        return self._by_block.get(block)

    def lookup(
        self,
        keys: list[bytes],
        contents: list[bytes],
        num_tokens: int,
        record: bool = True,
    ) -> LookupResult:
        """The blocks of the longest cached chain for a request of ``num_tokens`` tokens whose full
        blocks have ``keys``/``contents``. At most ``(num_tokens - 1) // block_size`` blocks are
        reused: the last token is always computed, so the model yields logits for it. With
        ``record`` the lookup counts in the query/hit/stop counters and in the entries' hits."""
        limit = min(len(keys), (num_tokens - 1) // self.block_size)
        blocks: list[int] = []
        for key in keys[:limit]:
            entry = self._by_key.get(key)
            if entry is None:
                break
            blocks.append(entry.block)
        stop = self._stop_reason(keys, contents, len(blocks), limit)
        if record:
            self.lookups += 1
            self.queried_tokens += num_tokens
            self.hit_tokens += len(blocks) * self.block_size
            self.stops[stop] += 1
            for key in keys[: len(blocks)]:
                self._by_key[key].hits += 1
        return LookupResult(blocks, stop)

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
        """Registers ``block`` as holding ``key``. False when the key is already held by another
        block (the caller keeps its duplicate unregistered) or the block already holds a key."""
        if key in self._by_key or block in self._by_block:
            return False
        self._by_key[key] = Entry(block, content, parent, position)
        self._by_block[block] = key
        self._contents[content] += 1
        self._evicted.pop(key, None)
        return True

    def remove_block(self, block: int, evicted: bool) -> None:
        """Drops ``block``'s entry; ``evicted`` remembers the key to explain later misses."""
        key = self._by_block.pop(block)
        entry = self._by_key.pop(key)
        self._contents[entry.content] -= 1
        if self._contents[entry.content] == 0:
            del self._contents[entry.content]
        if evicted:
            self._evicted[key] = None
            if len(self._evicted) > self._evicted_memory:
                self._evicted.popitem(last=False)

    def clear(self) -> list[int]:
        """Forgets every entry (counters stay, they are monotonic). Returns the blocks dropped."""
        blocks = list(self._by_block)
        self._by_key.clear()
        self._by_block.clear()
        self._contents.clear()
        self._evicted.clear()
        return blocks

    def top_prefixes(self, limit: int, tier: Tier = "gpu") -> list[PrefixStat]:
        """The most reused prefixes: entries with hits, each the deepest block of its chain with
        that hit count (a 2048-token prefix hit 99 times is one row, not 128), by hits x tokens."""
        dominated: set[bytes] = set()
        for entry in self._by_key.values():
            parent = self._by_key.get(entry.parent) if entry.parent is not None else None
            if entry.hits > 0 and parent is not None and parent.hits == entry.hits:
                dominated.add(entry.parent)  # type: ignore[arg-type]
        rows = [
            PrefixStat(key.hex()[:16], (e.position + 1) * self.block_size, e.hits, e.block, tier)
            for key, e in self._by_key.items()
            if e.hits > 0 and key not in dominated
        ]
        rows.sort(key=lambda r: (r.hits * r.tokens, r.tokens), reverse=True)
        return rows[:limit]

    def check_integrity(self) -> None:
        assert len(self._by_key) == len(self._by_block), "key and block maps differ in size"
        for key, entry in self._by_key.items():
            assert self._by_block.get(entry.block) == key, f"block {entry.block} maps elsewhere"
        assert sum(self._contents.values()) == len(self._by_key), "content counts drifted"
        assert self.hit_tokens <= self.queried_tokens
        assert sum(self.stops.values()) == self.lookups
