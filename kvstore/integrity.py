"""The KVCacheManager's invariants, checked from the outside (tests call it after every step)
over the block store and the requests that ``KVCacheManager.check_integrity`` hands in."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvstore.requests import Request, Status, cdiv, table_blocks

if TYPE_CHECKING:
    from kvstore.block_store import BlockStore


def check_integrity(store: BlockStore, requests: Mapping[str, Request], bs: int) -> None:
    """Raises AssertionError on the first broken invariant of a manager's ``store`` and
    ``requests`` (blocks of ``bs`` tokens)."""

    pool, index = store.pool, store.index
    holders: Counter[int] = Counter()
    cpu_held: list[int] = []
    for req_id, r in requests.items():
        assert r.req_id == req_id
        assert 0 <= r.num_computed <= len(r.token_ids), f"{req_id}: computed past its tokens"
        assert len(r.contents) == len(r.keys) == len(r.token_ids) // bs, f"{req_id}: hashes"
        needed = cdiv(len(r.token_ids), bs)
        if r.status is Status.RUNNING:
            needed = table_blocks(len(r.token_ids), bs)
            assert len(r.block_ids) == needed, f"{req_id}: {len(r.block_ids)} blocks, need {needed}"
            assert not r.cpu_block_ids, f"{req_id}: running with CPU blocks"
            assert r.num_registered <= r.num_computed // bs, f"{req_id}: registered uncomputed"
            holders.update(r.block_ids)
            for i, block in enumerate(r.block_ids[: len(r.keys)]):
                key = index.key_of_block(block)
                assert key is None or key == r.keys[i], (
                    f"{req_id}: block {block} caches other content"
                )
        elif r.status is Status.SWAPPED:
            assert not r.block_ids and len(r.cpu_block_ids) == needed, f"{req_id}: swap table"
            cpu_held.extend(r.cpu_block_ids)
        else:
            assert not r.block_ids and not r.cpu_block_ids, f"{req_id}: dropped but holds blocks"
    for block in range(pool.num_blocks):
        assert pool.ref_counts[block] == holders[block], (
            f"block {block}: ref {pool.ref_counts[block]}, held by {holders[block]} table entries"
        )
    store.check_integrity(cpu_held)
