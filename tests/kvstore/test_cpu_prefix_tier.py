"""Exact tests of the CPU tier as a second-level prefix cache (pure Python, exact block ids).

Every test runs ``check_integrity()`` after each manager call. The daemon's duty, running the
queued copies (``take_pending``) before anything else, is played by the tests.
"""

from __future__ import annotations

from kvstore import protocol as p
from kvstore.cost_model import LinearCost, SwapCalibration
from kvstore.manager import KVCacheManager
from kvstore.requests import Status, TransferPlan
from kvstore.stats import block_info, block_map
from tests.kvstore.test_host_machine import chain

BS = 16
PROMPT = list(range(49))  # 3 full blocks + 1 token


def tiered(gpu: int = 4, cpu: int = 4, load_s: float = 1e-6) -> KVCacheManager:
    """A manager with the CPU prefix tier on; ``load_s`` per block swapped in (recompute costs
    10 ms per 16 tokens: 1 us loads, 1 s does not)."""
    m = KVCacheManager(gpu, cpu, BS, cpu_prefix_cache=True)
    m.pricing.calibration = SwapCalibration(64, LinearCost(0, load_s), LinearCost(0, load_s))
    m.pricing.prefill_profiles["w"] = [(16, 0.01), (64, 0.04), (256, 0.16)]
    return m


def computed_and_freed(m: KVCacheManager, req_id: str, tokens: list[int]) -> list[int]:
    """Admits ``tokens``, reports them all computed (their full blocks join the index), frees."""
    blocks = m.admit(req_id, "w", tokens, None).block_ids
    m.append(req_id, "w", [], len(tokens))
    m.free(req_id, "w")
    m.check_integrity()
    return blocks


def test_an_evicted_prefix_is_demoted_at_eviction_and_loaded_back() -> None:
    m = tiered()
    assert computed_and_freed(m, "a", PROMPT) == [0, 1, 2, 3]
    assert m.pool.lru_order() == [0, 1, 2] and m.pool.num_free == 1
    # 62 new tokens and their two lookahead slots need the whole pool: the free block 3, then
    # blocks 0, 1, 2 evicted.
    assert m.admit("b", "w", list(range(100, 162)), None).block_ids == [3, 0, 1, 2]
    assert m.take_pending() == TransferPlan(swap_out=[(0, 0), (1, 1), (2, 2)])
    assert m.store.counts["demoted_at_eviction"] == 3 and m.store.counts["dropped"] == 0
    assert [r.tier for r in m.index.top_prefixes(10)] == []  # no hits yet
    assert m.cpu.lru_order() == [0, 1, 2] and m.cpu.num_demoted == 3
    m.check_integrity()
    m.free("b", "w")
    # The same prompt again: the chain lives in the CPU tier only; loading is cheaper.
    placement = m.admit("c", "w", [*PROMPT, 7], None, now=5.0)
    assert placement.block_ids == [3, 0, 1, 2]
    assert placement.num_computed == 48 and placement.num_cached_tokens == 48
    plan = m.take_pending()
    assert plan.swap_in == [(0, 3), (1, 0), (2, 1)] and plan.swap_out == []
    m.record_transfer(plan, 0.0, 0.002)
    [decision] = m.decisions.recent()
    assert decision["kind"] == "prefix" and decision["mode"] == "load"
    assert decision["blocks"] == 3 and decision["tokens"] == 48 and decision["at"] == 5.0
    assert decision["predicted_swap_s"] == 3e-6 and decision["actual_s"] == 0.002
    assert m.index.hit_tokens == 48 and m.index.hit_tokens_cpu == 48
    assert m.store.counts["loaded"] == 3
    # Both tiers hold the prefix now: the entries name GPU blocks 3, 0, 1 and CPU blocks 0-2.
    assert [m.index.key_of_block(b) for b in (3, 0, 1)] == [
        m.index.key_of_cpu_block(c) for c in (0, 1, 2)
    ]
    m.check_integrity()


def test_recompute_when_loading_is_dearer_then_the_gpu_copy_joins_the_cpu_entry() -> None:
    m = tiered(load_s=1.0)
    computed_and_freed(m, "a", PROMPT)
    m.admit("b", "w", list(range(100, 162)), None)
    m.take_pending()
    m.free("b", "w")
    placement = m.admit("c", "w", [*PROMPT, 7], None)
    assert placement.num_computed == 0 and placement.num_cached_tokens == 0
    assert m.take_pending() == TransferPlan()
    [decision] = m.decisions.recent()
    assert decision["mode"] == "recompute" and decision["reason"] == "recompute is cheaper"
    assert m.store.counts["recomputed"] == 3 and m.index.hit_tokens == 0
    m.append("c", "w", [], 50)  # the worker recomputed the prompt: its blocks register
    m.check_integrity()
    for position, block in enumerate(placement.block_ids[:3]):
        key = m.index.key_of_block(block)
        entry = m.index.entry(key) if key is not None else None
        assert entry is not None and entry.block == block and entry.cpu_block == position
    assert m.cpu.num_demoted == 3  # the CPU copies stay, as a second copy


def test_write_back_copies_the_next_victims_ahead_so_eviction_copies_nothing() -> None:
    m = tiered()
    computed_and_freed(m, "a", PROMPT)
    assert m.store.plan_write_back(ahead=2, limit=8) == 2  # LRU head: blocks 0 and 1
    assert m.take_pending() == TransferPlan(swap_out=[(0, 0), (1, 1)])
    assert m.store.plan_write_back(ahead=2, limit=8) == 0  # already copied
    m.check_integrity()
    m.admit("b", "w", list(range(100, 162)), None)
    # Blocks 0 and 1 had copies; block 2 is copied at eviction.
    assert m.take_pending() == TransferPlan(swap_out=[(2, 2)])
    assert m.store.counts["demoted"] == 2 and m.store.counts["demoted_at_eviction"] == 1
    m.check_integrity()


def test_a_mixed_chain_loads_only_what_the_gpu_lacks() -> None:
    m = tiered(gpu=5, cpu=4)
    computed_and_freed(m, "a", PROMPT)  # blocks 0-2 cached, LRU order 0, 1, 2
    m.admit("b", "w", list(range(100, 133)), None)  # 3 blocks: free 3, 4, then evicts 0
    assert m.take_pending() == TransferPlan(swap_out=[(0, 0)])
    m.free("b", "w")
    placement = m.admit("c", "w", [*PROMPT, 7], None)
    # Position 0 comes back from CPU block 0 into a fresh block; positions 1, 2 are on the GPU.
    assert placement.num_computed == 48
    assert placement.block_ids[1:3] == [1, 2]
    assert m.take_pending().swap_in == [(0, placement.block_ids[0])]
    assert m.index.hit_tokens == 48 and m.index.hit_tokens_cpu == 16
    m.check_integrity()


def test_swapped_requests_win_cpu_space_from_demoted_prefixes() -> None:
    m = tiered(gpu=8, cpu=3)
    computed_and_freed(m, "a", PROMPT)
    m.store.plan_write_back(ahead=3, limit=3)
    m.take_pending()
    assert m.cpu.num_free == 0 and m.cpu.num_demoted == 3
    m.admit("v", "w", list(range(200, 240)), None)  # 3 blocks, to be swapped out
    m.append("v", "w", [], 40)
    modes, plan = m.preempt(["v"], "w", 1.0)
    assert modes == ["swap"] and [c for _, c in plan.swap_out] == [0, 1, 2]
    # The demoted copies were given up; the GPU copies keep the entries alive.
    assert m.cpu.num_demoted == 0 and len(m.index) == 3 + 2  # a's 3 blocks, v's 2 full
    assert m.requests["v"].status is Status.SWAPPED
    m.check_integrity()


def test_prefixes_held_nowhere_else_are_dropped_when_the_cpu_tier_is_full() -> None:
    m = tiered(gpu=4, cpu=1)
    computed_and_freed(m, "a", PROMPT)
    m.admit("b", "w", list(range(100, 162)), None)
    # One CPU block for three victims: each demotion evicts the previous one.
    assert m.take_pending().swap_out == [(0, 0), (1, 0), (2, 0)]
    assert m.store.counts["dropped"] == 2 and len(m.index) == 1
    entry = m.index.entry(m.index.key_of_cpu_block(0) or b"")
    assert entry is not None and entry.position == 2 and entry.block is None
    m.check_integrity()


def test_reset_drops_both_tiers_and_the_tier_off_drops_evicted_prefixes() -> None:
    m = tiered()
    computed_and_freed(m, "a", PROMPT)
    m.admit("b", "w", list(range(100, 162)), None)
    m.take_pending()
    m.free("b", "w")
    assert m.reset_prefix_cache() == 3 and m.cpu.num_free == 4 and len(m.index) == 0
    m.check_integrity()
    off = KVCacheManager(4, 4, BS)  # the tier is off by default in the pure manager
    computed_and_freed(off, "a", PROMPT)
    off.admit("b", "w", list(range(100, 162)), None)
    assert off.take_pending() == TransferPlan() and off.store.counts["dropped"] == 3
    off.check_integrity()


def test_block_map_and_block_info_name_every_state() -> None:
    m = tiered(gpu=5, cpu=4)
    computed_and_freed(m, "a", PROMPT)  # GPU 0-2 cached, 3-4 free
    m.admit("b", "w", list(range(100, 133)), None)  # GPU 3, 4 and (evicting 0) 0
    m.take_pending()
    m.admit("v", "w", list(range(300, 310)), None)  # needs 1 block: evicts 1
    m.take_pending()
    m.append("v", "w", [], 10)
    m.preempt(["v"], "w", 0.0)  # swapped to CPU block 2
    codes = {name: i for i, name in enumerate(p.BLOCK_STATES)}
    reply = block_map(m)
    assert (
        list(reply.gpu)
        == [codes["running"]] + [codes["free"]] + [codes["cached"]] + [codes["running"]] * 2
    )
    assert list(reply.cpu) == [codes["demoted"], codes["demoted"], codes["swapped"], 0]
    info = block_info(m, "cpu", 0)
    assert isinstance(info, p.BlockInfo)
    assert info.state == "demoted" and info.prefix_tokens == 16 and info.other_tier_block is None
    swapped = block_info(m, "cpu", 2)
    assert isinstance(swapped, p.BlockInfo) and swapped.owners == ["v"]
    assert isinstance(block_info(m, "gpu", 5), p.Error)
    m.check_integrity()


def test_a_demotion_queued_after_a_load_never_overwrites_the_load_source() -> None:
    """Found by the state machine: the blocks allocated after a load evict a cached block, whose
    demotion must not take the CPU block the queued load still has to read."""
    m = KVCacheManager(9, 2, 4, cpu_prefix_cache=True)  # 8 when tables had no lookahead slot
    m.pricing.calibration = SwapCalibration(64, LinearCost(0, 1e-6), LinearCost(0, 1e-6))
    m.pricing.prefill_profiles["w"] = [(4, 0.01), (64, 0.16)]
    for i, (prompt, free) in enumerate(
        [([1] * 9, True), ([1] * 13, True), ([0, 1, 2] * 4, False), ([2] * 4 + [0] * 9, True)]
    ):
        m.admit(f"r{i}", "w", prompt, None)
        m.take_pending()
        m.append(f"r{i}", "w", [], len(prompt))
        if free:
            m.free(f"r{i}", "w")
    assert m.cpu.lru_order() == [0, 1]  # [1] * 9's two blocks, demoted
    placement = m.admit("again", "w", [1] * 9, None)
    plan = m.take_pending()
    assert placement.num_computed == 8 and plan.swap_in == [(0, 1), (1, 3)]
    assert plan.swap_out == [] and m.store.counts["dropped"] >= 1  # evicted without a copy
    assert not {c for _, c in plan.swap_out} & {0, 1}  # no demotion into the load's sources
    m.check_integrity()


def test_demotions_at_eviction_stop_at_their_budget_until_the_queue_is_taken() -> None:
    """A budget of 2 demotions at eviction: a's 3 cached blocks evicted in one call, the first
    two copied (to CPU blocks 0 and 1), the third dropped; once the queue is taken the budget
    is whole again, and c's blocks evicted later are demoted the same way."""
    m = KVCacheManager(4, 4, BS, cpu_prefix_cache=True, demote_at_eviction=2)
    assert computed_and_freed(m, "a", PROMPT) == [0, 1, 2, 3]
    assert m.admit("b", "w", list(range(100, 162)), None).block_ids == [3, 0, 1, 2]
    assert m.take_pending() == TransferPlan(swap_out=[(0, 0), (1, 1)])
    assert (m.store.counts["demoted_at_eviction"], m.store.counts["over_budget"]) == (2, 1)
    assert m.cpu.lru_order() == [0, 1]
    m.free("b", "w")
    m.check_integrity()
    c = [7] * 48 + [1]
    assert computed_and_freed(m, "c", c) == [3, 0, 1, 2]  # b's blocks, in the order b freed them
    assert m.pool.lru_order() == [3, 0, 1]
    assert m.admit("d", "w", list(range(200, 262)), None).block_ids == [2, 3, 0, 1]
    assert m.take_pending() == TransferPlan(swap_out=[(3, 2), (0, 3)])
    assert (m.store.counts["demoted_at_eviction"], m.store.counts["over_budget"]) == (4, 2)
    keys_a, _ = chain(PROMPT, None, BS)
    keys_c, _ = chain(c, None, BS)
    assert [m.index.key_of_cpu_block(b) for b in range(4)] == keys_a[:2] + keys_c[:2]
    m.check_integrity()


def test_a_write_back_pass_between_calls_copies_a_bounded_number_of_bytes() -> None:
    """Between calls the daemon copies the next victims ahead, at most ``WRITE_BACK_BYTES`` per
    pass whatever the block size: a pass sized in blocks held the next Step ~2 ms for the 8B
    shape's 2 MiB blocks."""
    from kvstore.service import WRITE_BACK_BYTES, KVService

    class Recorder:
        block_bytes = WRITE_BACK_BYTES // 2  # two blocks per pass

        def __init__(self) -> None:
            self.copied: list[tuple[int, int]] = []

        def swap_out(self, pairs: list[tuple[int, int]]) -> float:
            self.copied += pairs
            return 0.25 * len(pairs)

        def swap_in(self, pairs: list[tuple[int, int]]) -> float:
            return 0.0

        def export(self) -> p.PoolInfo:
            return p.PoolInfo("shm", [1], "float32", 16)

    m = tiered(gpu=8, cpu=8)
    mover = Recorder()
    service = KVService(m, mover, 60, 60, write_back_ahead=8)
    computed_and_freed(m, "a", list(range(80)))  # 5 cached blocks at the LRU's head
    assert service.between_calls() == 2 and mover.copied == [(0, 0), (1, 1)]
    assert service.between_calls() == 2 and service.between_calls() == 1
    assert service.between_calls() == 0 and len(mover.copied) == 5
    assert service.busy_s == {"write_back": 1.25}  # its seconds, as the mover timed them
    m.check_integrity()
