"""Exact tests of the pure-Python kvstore core: block ids, counts and counters."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstore.block_pool import BlockPool, CpuTier, NoFreeBlocks
from kvstore.cost_model import LinearCost, SwapCalibration
from kvstore.manager import KVCacheManager
from kvstore.protocol import LOOKAHEAD_SLOTS
from kvstore.requests import KVError, Status

BS = 16


def manager(gpu: int, cpu: int = 0, bs: int = BS) -> KVCacheManager:
    return KVCacheManager(gpu, cpu, bs)


def test_core_does_not_import_torch() -> None:
    modules = [
        "block_pool",
        "prefix_index",
        "manager",
        "integrity",
        "cost_model",
        "leases",
        "protocol",
        "service",
        "stats",
        "client",
    ]
    code = f"import sys\nfor m in {modules!r}: __import__('kvstore.' + m)\n"
    code += "assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lru_eviction_order() -> None:
    pool = BlockPool(4)
    blocks, evicted = pool.allocate(4)
    assert blocks == [0, 1, 2, 3] and evicted == []
    for b in (2, 0, 3):
        pool.mark_cached(b)
    pool.release([2, 0, 3, 1])  # 2, 0, 3 cached in that order; 1 free
    assert pool.lru_order() == [2, 0, 3] and pool.num_free == 1
    pool.check_integrity()
    # A free block goes first: no eviction while one is left.
    assert pool.allocate(1) == ([1], [])
    pool.ref(0)  # a prefix hit on 0 takes it out of the LRU ...
    pool.release([0])  # ... and releasing makes it the most recently used
    assert pool.lru_order() == [2, 3, 0]
    assert pool.allocate(2) == ([2, 3], [2, 3])
    assert pool.lru_order() == [0]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    pool.check_integrity()


def test_pool_rejects_double_free_and_sharing_a_free_block() -> None:
    pool = BlockPool(2)
    (b,), _ = pool.allocate(1)
    pool.release([b])
    with pytest.raises(ValueError, match="double free"):
        pool.release([b])
    with pytest.raises(ValueError, match="free"):
        pool.ref(b)
    swap = CpuTier(2)
    assert swap.allocate(2) == ([0, 1], [])
    swap.release([1])
    with pytest.raises(ValueError, match="double free"):
        swap.release([1])


def test_shared_prefix_100_requests() -> None:
    m = manager(1000)
    prefix = list(range(2048))
    for i in range(100):
        suffix = [10_000 + i * 1000 + j for j in range(100)]
        placement = m.admit(f"r{i}", "w", prefix + suffix, None)
        assert placement.num_cached_tokens == (0 if i == 0 else 2048)
        # The worker computes the prompt and reports it with the first sampled token.
        m.append(f"r{i}", "w", [7], 2148)
        m.check_integrity()
    assert m.pool.num_used == 128 + 100 * 7 == 828
    assert m.index.hit_tokens == 99 * 2048
    assert m.index.queried_tokens == 100 * 2148
    assert m.index.stops["no_entry"] == 100
    tables = [m.requests[f"r{i}"].block_ids for i in range(100)]
    assert all(t[:128] == tables[0][:128] for t in tables)
    assert all(m.pool.ref_counts[b] == 100 for b in tables[0][:128])
    [top] = m.index.top_prefixes(1)
    assert (top.tokens, top.hits) == (2048, 99)


def test_hit_is_capped_so_the_last_token_is_computed() -> None:
    m = manager(10)
    m.admit("a", "w", list(range(32)), None)
    m.append("a", "w", [], 32)
    placement = m.admit("b", "w", list(range(32)), None)
    assert placement.num_cached_tokens == 16  # block 1 is recomputed into a fresh block
    assert m.index.stops["partial_block"] == 1
    m.append("b", "w", [], 32)  # its duplicate of block 1 stays unregistered
    assert len(m.index) == 2
    m.check_integrity()


def test_a_request_that_reuses_no_prefix_computes_every_token_and_still_registers() -> None:
    m = manager(10)
    m.admit("a", "w", list(range(40)), None)
    m.append("a", "w", [], 40)
    lookups = m.index.lookups
    placement = m.admit("b", "w", list(range(40)), None, reuse_prefix=False)
    assert (placement.num_computed, placement.num_cached_tokens) == (0, 0)
    assert placement.block_ids == [3, 4, 5]  # fresh blocks, not a's 0 and 1
    assert m.index.lookups == lookups  # no lookup counted: none was asked for
    m.append("b", "w", [], 40)  # its blocks duplicate a's: they stay unregistered
    assert len(m.index) == 2
    assert m.preempt(["b"], "w", 0.0)[0] == ["recompute"]  # no CPU tier: dropped
    placement, _ = m.resume("b", "w")
    assert placement.num_computed == 0  # placed again without the cached prefix
    m.check_integrity()
    m.free("a", "w")
    c = m.admit("c", "w", list(range(40)), None)
    assert c.num_cached_tokens == 32  # a's registered blocks serve later requests
    m.check_integrity()


def test_fork_copies_a_shared_partial_block_exactly_when_written() -> None:
    m = manager(20)
    m.admit("p", "w", list(range(40)), None)  # blocks 0, 1, 2 (2 is partial: 8 tokens)
    m.append("p", "w", [], 40)
    for child in ("c1", "c2", "c3"):
        assert m.fork("p", "w", child).block_ids == [0, 1, 2]
    assert [m.pool.ref_counts[b] for b in (0, 1, 2)] == [4, 4, 4]
    # The first three writers into shared block 2 get private copies; the last writes in place.
    assert m.append("p", "w", [100], 40).copies == [(2, 2, 3)]
    assert m.append("c1", "w", [101], 40).copies == [(2, 2, 4)]
    assert m.append("c2", "w", [102], 40).copies == [(2, 2, 5)]
    assert m.append("c3", "w", [103], 40).copies == []
    assert [m.requests[r].block_ids[2] for r in ("p", "c1", "c2", "c3")] == [3, 4, 5, 2]
    # Full blocks stay shared; a write that starts a new block copies nothing.
    assert [m.pool.ref_counts[b] for b in (0, 1)] == [4, 4]
    assert m.pool.num_used == 6
    m.check_integrity()
    # 48 tokens: p's cached blocks 0 and 1, block 6, and the lookahead block 7, the next
    # token's. The fork shares it too, so the first write into it copies it; the table needs
    # no new block for that token.
    assert m.admit("q", "w", list(range(48)), None).block_ids == [0, 1, 6, 7]
    m.append("q", "w", [], 48)
    m.fork("q", "w", "q1")
    growth = m.append("q", "w", [9], 48)
    assert growth.copies == [(3, 7, 8)] and growth.new_block_ids == []
    # The token that fills block 3 brings the next lookahead block.
    assert m.append("q", "w", list(range(15)), 49).new_block_ids == [9]
    m.check_integrity()


def test_salted_requests_never_share() -> None:
    m = manager(40)
    tokens = list(range(64))
    m.admit("a", "w", tokens, b"tenant-a")
    m.append("a", "w", [], 64)
    assert m.admit("b", "w", tokens, b"tenant-b").num_cached_tokens == 0
    assert m.admit("c", "w", tokens, None).num_cached_tokens == 0
    assert m.index.stops["salt"] == 2
    assert m.admit("d", "w", tokens, b"tenant-a").num_cached_tokens == 48
    shared = set(m.requests["a"].block_ids) & set(m.requests["b"].block_ids)
    assert not shared and not set(m.requests["c"].block_ids) & set(m.requests["a"].block_ids)
    m.check_integrity()


def test_miss_reasons_no_entry_and_evicted() -> None:
    m = manager(5)
    m.admit("a", "w", list(range(64)), None)  # four full blocks and the lookahead block
    m.append("a", "w", [], 64)
    m.free("a", "w")  # four cached blocks in the LRU, one free
    m.admit("x", "w", list(range(1000, 1064)), None)  # evicts all four
    m.free("x", "w")
    assert m.admit("b", "w", list(range(64)), None).num_cached_tokens == 0
    assert dict(m.index.stops) == {"no_entry": 2, "evicted": 1, "salt": 0, "partial_block": 0}
    m.check_integrity()


def test_no_space_is_all_or_nothing() -> None:
    m = manager(3)
    m.admit("a", "w", list(range(40)), None)
    with pytest.raises(KVError) as err:
        m.admit("b", "w", list(range(100, 120)), None)
    assert err.value.code == "no_space" and "b" not in m.requests
    with pytest.raises(KVError) as err:
        m.append("a", "w", list(range(9)), 0)
    assert err.value.code == "no_space" and len(m.requests["a"].token_ids) == 40
    m.check_integrity()


def test_a_running_table_holds_the_slots_of_the_next_two_tokens() -> None:
    """The lookahead slots: a worker computes the tokens it samples before reporting them, so
    the table always reaches ``LOOKAHEAD_SLOTS`` (2) slots past the last known token; a swap
    moves only the blocks that hold tokens."""
    assert LOOKAHEAD_SLOTS == 2
    m = manager(8, 8)
    m.pricing.calibration = SwapCalibration(1024, LinearCost(0.0, 1e-6), LinearCost(0.0, 1e-6))
    m.pricing.prefill_profiles["w"] = [(16, 1.0), (1024, 2.0)]  # recompute is far dearer
    assert m.admit("a", "w", list(range(32)), None).block_ids == [0, 1, 2]  # 2 full, 1 ahead
    m.append("a", "w", [], 32)
    assert m.append_tokens("w", ["a"], [7], [32]) == []  # in the lookahead block: no growth
    m.append("a", "w", list(range(13)), 33)  # 46 tokens: slots 46 and 47 still in block 2
    assert m.requests["a"].block_ids == [0, 1, 2]
    assert m.append_tokens("w", ["a"], [7], [46]) == [0]  # slot 48 needs a block: general
    growth = m.append("a", "w", [7], 47)  # computed before it was reported (fed)
    assert growth.new_block_ids == [3] and growth.copies == []
    assert m.append_tokens("w", ["a"], [7], [47]) == [0]  # fills block 2 (to hash): general
    assert m.append("a", "w", [7], 48).new_block_ids == []
    assert m.requests["a"].block_ids == [0, 1, 2, 3] and len(m.requests["a"].keys) == 3
    m.check_integrity()
    modes, plan = m.preempt(["a"], "w", now=1.0)
    assert modes == ["swap"] and plan.swap_out == [(0, 0), (1, 1), (2, 2)]  # not block 3
    assert m.pool.num_used == 0 and m.cpu.num_free == 5
    m.check_integrity()
    # Blocks 0 and 1 are cached still; block 2 holds the last token, whose logits the worker
    # needs, so it comes back from the CPU into a fresh block 4; 5 is the lookahead.
    placement, plan = m.resume("a", "w")
    assert placement.block_ids == [0, 1, 4, 5] and plan.swap_in == [(2, 4)]
    assert placement.num_computed == 47
    m.check_integrity()


def test_preempt_swap_then_resume_reuses_cached_prefix() -> None:
    m = manager(8, 8)
    m.pricing.calibration = SwapCalibration(1024, LinearCost(0.0, 1e-6), LinearCost(0.0, 1e-6))
    m.pricing.prefill_profiles["w"] = [(16, 1.0), (1024, 2.0)]  # recompute is far dearer
    m.admit("a", "w", list(range(40)), None)
    m.append("a", "w", [1], 40)
    modes, plan = m.preempt(["a"], "w", now=1.0)
    assert modes == ["swap"] and plan.swap_out == [(0, 0), (1, 1), (2, 2)]
    assert m.requests["a"].status is Status.SWAPPED and m.pool.num_used == 0
    m.check_integrity()
    placement, plan = m.resume("a", "w")
    # Blocks 0 and 1 were still cached on the GPU: only block 2 comes back from the CPU.
    assert placement.block_ids == [0, 1, 3] and placement.num_computed == 40
    assert plan.swap_in == [(2, 3)] and m.cpu.num_free == 8
    assert m.decisions.recent()[0]["mode"] == "swap"
    m.check_integrity()


def test_preempt_recompute_when_cheaper_or_cpu_full() -> None:
    m = manager(8, 4)
    m.pricing.calibration = SwapCalibration(1024, LinearCost(1.0, 1.0), LinearCost(1.0, 1.0))
    m.pricing.prefill_profiles["w"] = [(16, 0.001), (1024, 0.01)]
    m.admit("a", "w", list(range(40)), None)
    m.append("a", "w", [1], 40)
    modes, plan = m.preempt(["a"], "w", now=0.0)
    assert modes == ["recompute"] and plan.swap_out == []
    decision = m.decisions.recent()[-1]
    assert decision["reason"] == "recompute is cheaper"
    assert decision["predicted_swap_s"] == pytest.approx(2 * (1.0 + 3.0))
    placement, _ = m.resume("a", "w")
    assert placement.num_computed == 32  # the cached full blocks come back as hits
    m.pricing.calibration = SwapCalibration(1024, LinearCost(0.0, 1e-9), LinearCost(0.0, 1e-9))
    m.append("a", "w", [], 41)
    m.cpu.allocate(2)  # leave 2 CPU blocks for a request holding 3
    assert m.preempt(["a"], "w", now=0.0)[0] == ["recompute"]
    assert m.decisions.recent()[-1]["reason"] == "CPU tier full"
    m.pool.check_integrity()


def test_orphans_adopted_or_reclaimed_after_grace() -> None:
    m = manager(10)
    m.admit("a", "w1", list(range(20)), None)
    m.append("a", "w1", [5, 6], 20)
    m.admit("b", "w1", list(range(100, 120)), None)
    with pytest.raises(KVError, match="live worker"):
        m.adopt("a", "w2", list(range(20)))
    assert m.orphan_worker("w1", now=10.0) == ["a", "b"]
    with pytest.raises(KVError, match="share no prefix"):
        m.adopt("a", "w2", [99])
    assert m.requests["a"].worker == "w1" and m.requests["a"].orphaned_at == 10.0  # untouched
    # The new worker saw one streamed token of the two the kvstore holds: cut to the common prefix.
    placement, plan = m.adopt("a", "w2", [*range(20), 5])
    assert placement.num_computed == 20 and len(m.requests["a"].token_ids) == 21
    assert m.requests["a"].worker == "w2" and not plan.swap_in
    assert m.reclaim_orphans(now=20.0, grace_s=30.0) == []
    assert m.reclaim_orphans(now=40.0, grace_s=30.0) == ["b"]
    assert "b" not in m.requests and m.pool.num_used == 2
    m.check_integrity()


def test_an_adopted_request_takes_the_tokens_its_dead_worker_streamed_but_never_reported() -> None:
    """w1 streamed tokens 32 and 33 to the client, then died before reporting them: w2 adopts
    with all 34. The kvstore knows them now, and the table has a block for the one past the
    boundary (a worker that computed token 32 with three blocks in its table had crashed)."""
    m = manager(10)
    m.admit("a", "w1", list(range(30)), None)
    m.append("a", "w1", [30, 31], 31)  # tokens 0..30 computed, 31 known
    assert m.orphan_worker("w1", now=1.0) == ["a"]
    placement, plan = m.adopt("a", "w2", [*range(32), 7, 8])
    assert placement.block_ids == [0, 1, 2] and placement.num_computed == 31
    assert m.requests["a"].token_ids == [*range(32), 7, 8] and not plan.swap_in
    m.check_integrity()
    assert m.append("a", "w2", [9], 34).new_block_ids == []  # then on as usual
    m.check_integrity()


def swapped_out(gpu: int, cpu: int) -> KVCacheManager:
    """A manager whose request "a" of w1 (21 tokens, 20 computed) is swapped out."""
    m = manager(gpu, cpu)
    m.pricing.calibration = SwapCalibration(1024, LinearCost(0.0, 1e-6), LinearCost(0.0, 1e-6))
    m.pricing.prefill_profiles["w1"] = [(16, 1.0), (1024, 2.0)]  # recompute is far dearer
    m.admit("a", "w1", list(range(20)), None)
    m.append("a", "w1", [1], 20)
    assert m.preempt(["a"], "w1", now=1.0)[0] == ["swap"]
    return m


def test_streamed_tokens_of_an_adopted_swapped_request_get_blocks_past_the_swapped_ones() -> None:
    m = swapped_out(10, 10)
    m.orphan_worker("w1", now=2.0)
    placement, plan = m.adopt("a", "w2", [*range(20), 1, *range(100, 112)])  # 33: 3 blocks
    assert len(placement.block_ids) == 3 and len(m.requests["a"].token_ids) == 33
    assert len(plan.swap_in) <= 2 and placement.num_computed <= 20  # the swapped ones only
    m.check_integrity()


def test_an_adoption_that_cannot_be_placed_now_changes_no_tokens() -> None:
    m = swapped_out(3, 4)
    m.admit("b", "w1", list(range(100, 140)), None)  # the GPU is full
    m.orphan_worker("w1", now=2.0)
    with pytest.raises(KVError) as refused:
        m.adopt("a", "w2", [*range(20), 1, 5, 6])
    assert refused.value.code == "no_space"
    assert m.requests["a"].token_ids == [*range(20), 1]  # the streamed ones wait for a retry
    m.check_integrity()


def test_an_orphan_adopted_without_reuse_is_computed_again_in_fresh_blocks() -> None:
    """A request that wants its prompt's logprobs, orphaned mid-prefill: the new worker needs
    the logits of the part already computed, so it starts over (and never reads a cached
    prefix)."""
    m = manager(10)
    m.admit("a", "w1", list(range(40)), None, reuse_prefix=False)
    m.append("a", "w1", [], 32)  # two blocks computed (and registered) before w1 died
    assert m.orphan_worker("w1", now=1.0) == ["a"]
    placement, plan = m.adopt("a", "w2", list(range(40)), reuse_prefix=False)
    assert (placement.num_computed, placement.num_cached_tokens) == (0, 0)
    assert placement.block_ids == [3, 4, 5] and not plan.swap_in  # 0, 1 stay cached
    assert m.requests["a"].worker == "w2" and m.pool.num_used == 3
    m.check_integrity()


def test_an_append_may_count_its_own_tokens_as_computed() -> None:
    """A worker that fed a sampled token to its next step from the device reports the token and
    its KV together: 19 tokens, all computed; the table grows to 2 blocks as usual."""
    m = manager(10)
    m.admit("a", "w", list(range(17)), None)
    m.append("a", "w", [], 17)
    growth = m.append("a", "w", [100, 101], 19)
    assert growth.new_block_ids == [] and m.requests["a"].num_computed == 19
    assert m.requests["a"].block_ids == [0, 1]
    m.check_integrity()


def test_errors_name_the_problem() -> None:
    m = manager(10)
    m.admit("a", "w", [1, 2, 3], None)
    cases = [
        (lambda: m.admit("a", "w", [1], None), "duplicate_request"),
        (lambda: m.admit("e", "w", [], None), "bad_argument"),
        (lambda: m.append("zz", "w", [1], 0), "unknown_request"),
        (lambda: m.append("a", "other", [1], 0), "not_owner"),
        (lambda: m.append("a", "w", [1], 5), "bad_argument"),  # 4 tokens, 5 computed
        (lambda: m.resume("a", "w"), "wrong_state"),
    ]
    for call, code in cases:
        with pytest.raises(KVError) as err:
            call()
        assert err.value.code == code
    m.check_integrity()


def test_reset_prefix_cache_frees_idle_cached_blocks() -> None:
    m = manager(10)
    m.admit("a", "w", list(range(48)), None)
    m.append("a", "w", [], 48)
    m.admit("b", "w", list(range(1000, 1032)), None)
    m.append("b", "w", [], 32)
    m.free("a", "w")
    assert m.pool.num_cached_free == 3  # a's full blocks (not its lookahead block)
    assert m.reset_prefix_cache() == 5
    assert m.pool.num_cached_free == 0 and m.pool.num_free == 7 and len(m.index) == 0
    assert m.admit("c", "w", list(range(48)), None).num_cached_tokens == 0
    m.check_integrity()


def test_admission_leaves_the_watermark_for_running_requests() -> None:
    m = KVCacheManager(100, 0, 16, watermark=0.05)  # 5 blocks kept for growth
    m.admit("a", "w", list(range(16 * 90 - 2)), None)  # 90 blocks (2 lookahead slots)
    with pytest.raises(KVError, match="watermark") as err:
        m.admit("b", "w", list(range(5000, 5000 + 16 * 6 - 2)), None)  # 6 > 10 - 5
    assert err.value.code == "no_space"
    m.admit("c", "w", list(range(6000, 6000 + 16 * 5 - 2)), None)  # up to the watermark
    m.append("a", "w", list(range(16 * 5)), 16 * 90 - 2)  # a running request grows into it
    assert m.pool.num_available == 0
    m.check_integrity()


def test_step_order_running_requests_grow_before_admissions() -> None:
    """A step that appends and admits: the append gets the last block, the admission fails."""
    from kvstore import protocol as p
    from kvstore.service import KVService

    class NoMoves:
        block_bytes = 1

        def swap_out(self, pairs: list[tuple[int, int]]) -> float:
            raise AssertionError

        swap_in = swap_out

        def export(self) -> p.PoolInfo:
            return p.PoolInfo("shm", [1], "float32", 16)

    service = KVService(KVCacheManager(3, 0, 16), NoMoves(), 60, 60)
    service.handle(p.Register("w"))
    service.handle(p.Step("w", admits=[p.AdmitItem("a", list(range(30)))]))  # 2 blocks
    reply = service.handle(  # a's 31st token: its second lookahead slot needs a third block
        p.Step("w", admits=[p.AdmitItem("b", [1, 2])], appends=[p.AppendItem("a", [7], 30)])
    )
    assert isinstance(reply, p.StepReply)
    assert [g.req_id for g in reply.appended] == ["a"]
    assert [(e.req_id, e.code) for e in reply.errors] == [("b", "no_space")]


def test_a_placed_request_always_recomputes_its_last_token() -> None:
    """The worker needs the last token's logits: adopt/resume never count it as computed."""
    m = manager(20, 8)
    m.pricing.calibration = SwapCalibration(1024, LinearCost(0.0, 1e-9), LinearCost(0.0, 1e-9))
    m.admit("a", "w1", list(range(40)), None)
    m.append("a", "w1", [], 40)  # everything computed, the last block private (8 of 16 tokens)
    m.orphan_worker("w1", now=1.0)
    placement, _ = m.adopt("a", "w2", list(range(40)))
    assert placement.num_computed == 39 and placement.block_ids == m.requests["a"].block_ids
    # 48 tokens: the last block is full, computed and registered; rewriting it in place would
    # touch a cached block, so the request gets a fresh one and recomputes that block.
    m.admit("b", "w1", list(range(100, 148)), None)
    m.append("b", "w1", [], 48)
    old_last = m.requests["b"].block_ids[2]
    assert m.pool.cached[old_last]
    m.orphan_worker("w1", now=2.0)
    placement, _ = m.adopt("b", "w2", list(range(100, 148)))
    assert placement.num_computed == 32 and placement.block_ids[2] != old_last
    assert m.pool.cached[old_last] and m.pool.ref_counts[old_last] == 0  # still a cache entry
    # Resume after a swap of a fully computed request: the same rule.
    m.preempt(["a"], "w2", now=3.0)
    placement, plan = m.resume("a", "w2")
    assert placement.num_computed == 39 and plan.swap_in
    m.check_integrity()


def test_a_copy_on_write_copy_is_trusted_only_once_the_worker_confirms_it() -> None:
    """The worker makes a copy-on-write copy on its own stream, before its next forward, and
    confirms it in a later Step (``copied``). Until then the block's content is not trusted:
    it joins no prefix index, and a worker that takes the request over after its worker died
    (perhaps before making the copy) computes it again, in a fresh block."""
    m = manager(12)
    m.admit("p", "w1", list(range(20)), None)  # blocks 0, 1 (1: 4 tokens)
    m.append("p", "w1", [], 20)
    m.fork("p", "w1", "c")
    m.fork("p", "w1", "d")
    assert m.append("p", "w1", [20], 20).copies == [(1, 1, 2)]
    assert m.pool.is_copying(2) and not m.pool.is_copying(1)
    # Block 2 fills: p computed its 32 tokens, but the block's copy is not confirmed.
    assert m.append("p", "w1", list(range(21, 33)), 32).new_block_ids == [3]
    assert m.index.key_of_block(0) is not None and m.index.key_of_block(2) is None
    m.copied("w1", [2])
    m.append("p", "w1", [], 32)  # the next report registers it
    assert m.index.key_of_block(2) is not None and not m.pool.is_copying(2)
    m.check_integrity()
    # c's copy: w1 dies before confirming it. w2 computes c's block 1 again, in block 5.
    assert m.append("c", "w1", [99], 20).copies == [(1, 1, 4)]
    assert m.orphan_worker("w1", now=1.0) == ["p", "c", "d"]
    placement, _ = m.adopt("c", "w2", [*range(20), 99])
    assert placement.block_ids == [0, 5] and placement.num_computed == 16
    assert m.pool.ref_counts[4] == 0 and not m.pool.is_copying(4)  # freed with its flag
    m.check_integrity()


def test_a_swap_out_of_an_unconfirmed_copy_computes_it_again_after_the_resume() -> None:
    m = manager(12, 12)
    m.pricing.calibration = SwapCalibration(1024, LinearCost(0.0, 1e-6), LinearCost(0.0, 1e-6))
    m.pricing.prefill_profiles["w"] = [(16, 1.0), (1024, 2.0)]  # recompute is far dearer
    m.admit("p", "w", list(range(20)), None)
    m.append("p", "w", [], 20)
    m.fork("p", "w", "c")
    assert m.append("p", "w", [20], 20).copies == [(1, 1, 2)]
    assert m.preempt(["p"], "w", now=1.0)[0] == ["swap"]
    assert m.requests["p"].num_computed == 16  # block 1's copy is not trusted
    placement, _ = m.resume("p", "w")
    assert placement.num_computed == 16
    m.check_integrity()
