"""Exact tests of copy-on-write confirmations (``Step.copied``) that come after their block was
freed and taken again for another copy: a confirmation names only a block, so a late one must not
confirm the block's next copy."""

from __future__ import annotations

import pytest

from kvstore.block_pool import BlockPool
from kvstore.manager import KVCacheManager
from kvstore.requests import KVError


def test_a_late_confirmation_does_not_confirm_the_next_copy_into_its_block() -> None:
    """The state machine's counterexample: a fork of a fork whose worker dies with a copy not
    made, into a block a late confirmation named. The adopter computes that block again."""
    m = KVCacheManager(5, 0, 4)
    assert m.admit("r1", "w1", [1] * 9, None).block_ids == [0, 1, 2]
    m.append("r1", "w1", [], 9)  # blocks 0 and 1 join the index
    m.check_integrity()
    m.fork("r1", "w1", "r2")
    m.fork("r1", "w1", "r3")
    assert m.append("r1", "w1", [0], 9).copies == [(2, 2, 3)]
    assert m.append("r2", "w1", [1], 9).copies == [(2, 2, 4)]
    assert m.append("r3", "w1", [2], 9).copies == []  # block 2 is r3's alone now
    m.check_integrity()
    # w1 makes the copies into 3 and 4; r1 ends before w1 confirms them.
    m.free("r1", "w1")
    assert m.pool.ref_counts[3] == 0 and not m.pool.is_copying(3)
    m.check_integrity()
    m.fork("r2", "w1", "r4")  # r2 and r4 share block 4
    assert m.append("r2", "w1", [], 10).copies == [(2, 4, 3)]  # freed block 3, copying again
    assert m.pool.is_copying(3) and m.pool.is_copying(4)
    m.check_integrity()
    # The confirmation of the copies made before r1's free: 3's was r1's, not r2's.
    m.copied("w1", [3, 4])
    assert m.pool.is_copying(3) and not m.pool.is_copying(4)
    m.check_integrity()
    # w1 dies before it makes the copy 4 -> 3. Block 3 holds nothing of r2's.
    assert m.orphan_worker("w1", now=1.0) == ["r2", "r3", "r4"]
    with pytest.raises(KVError) as err:  # no block to compute block 3 again in
        m.adopt("r2", "w2", [1] * 10)
    assert err.value.code == "no_space"
    r2 = m.requests["r2"]
    assert (r2.block_ids, r2.num_computed, r2.worker) == ([0, 1, 3], 10, "w1")
    m.check_integrity()
    m.free("r3", None)  # block 2 is free again
    placement, _ = m.adopt("r2", "w2", [1] * 10)
    assert placement.block_ids == [0, 1, 2] and placement.num_computed == 8
    assert m.pool.ref_counts[3] == 0 and not m.pool.is_copying(3)
    m.check_integrity()


def test_late_confirmations_are_counted_per_worker_and_forgotten_when_it_dies() -> None:
    pool = BlockPool(2)
    assert pool.allocate(1) == ([0], [])
    pool.mark_copying(0, "w1")
    pool.release([0])  # w1's confirmation of 0 is late now
    assert pool.allocate(1) == ([1], [])
    assert pool.allocate(1) == ([0], [])
    pool.mark_copying(0, "w2")
    pool.copied("w1", [0])  # w1's late one: w2's copy is not confirmed by it
    assert pool.is_copying(0)
    pool.copied("w2", [0])
    assert not pool.is_copying(0)
    pool.check_integrity()
    # w1 dies owing a late confirmation of 1 and one of 0: none comes, none is waited for.
    pool.mark_copying(1, "w1")
    pool.release([1])
    pool.mark_copying(0, "w1")
    pool.forget_worker("w1")
    assert pool.is_copying(0)  # never confirmed: computed again by its adopter
    pool.release([0])
    assert pool.allocate(2) == ([1, 0], [])
    pool.mark_copying(1, "w1")  # w1 restarted under its id: its first confirmation counts
    pool.copied("w1", [1])
    assert not pool.is_copying(1) and pool.num_copying == 0
    pool.check_integrity()
