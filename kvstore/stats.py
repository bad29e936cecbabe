"""The stats reply: everything the admin API shows, read from the manager without mutating it."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import msgspec

from kvstore import protocol as p
from kvstore.requests import Status

if TYPE_CHECKING:
    from kvstore.leases import Leases
    from kvstore.manager import KVCacheManager


Number = TypeVar("Number", int, float)
STATUS: dict[Status, p.RequestStatus] = {
    Status.RUNNING: "running",
    Status.SWAPPED: "swapped",
    Status.DROPPED: "dropped",
}


def build_stats(
    m: KVCacheManager, block_bytes: int, leases: Leases, top: int, now: float
) -> p.Stats:
    """The service's stats: its manager ``m``, the bytes of one block, the workers' ``leases``."""
    pool, cpu, index = m.pool, m.cpu, m.index
    per_worker: dict[str, int] = {}
    for r in m.requests.values():
        per_worker[r.worker] = per_worker.get(r.worker, 0) + 1
    cal = m.pricing.calibration
    return p.Stats(
        block_size=m.block_size,
        block_bytes=block_bytes,
        admission_limit_blocks=m.admission_limit_blocks,
        gpu=p.TierStats(pool.num_blocks, pool.num_free, pool.num_used, pool.num_cached_free),
        cpu=p.TierStats(cpu.num_blocks, cpu.num_free, cpu.num_used, cpu.num_demoted),
        prefix_lookups=index.lookups,
        prefix_queried_tokens=index.queried_tokens,
        prefix_hit_tokens=index.hit_tokens,
        prefix_stops=dict(index.stops),
        top_prefixes=[
            p.PrefixRow(r.key, r.tokens, r.hits, r.block, r.tier) for r in index.top_prefixes(top)
        ],
        requests=[
            p.RequestRow(
                r.req_id,
                r.worker,
                STATUS[r.status],
                len(r.token_ids),
                r.num_computed,
                len(r.block_ids),
                len(r.cpu_block_ids),
                r.num_cached_tokens,
                r.preemptions,
                r.orphaned_at is not None,
            )
            for r in m.requests.values()
        ],
        workers=[
            p.WorkerRow(
                w.worker_id,
                w.device,
                w.pid,
                now - w.last_seen,
                per_worker.get(w.worker_id, 0),
                m.pricing.prefill_profiles.get(w.worker_id, []),
                m.pricing.recompute_profiles.get(w.worker_id, []),
                w.timeline,
                now - w.timeline_at if w.timeline is not None else 0.0,
                m.pricing.origins.get(w.worker_id),
            )
            for w in leases.workers.values()
        ],
        calibration=None
        if cal is None
        else p.Calibration(
            cal.block_bytes,
            cal.swap_out.fixed_s,
            cal.swap_out.per_unit_s,
            cal.swap_in.fixed_s,
            cal.swap_in.per_unit_s,
            cal.samples,
        ),
        decisions=[p.DecisionRow(**d) for d in m.decisions.recent()],  # type: ignore[arg-type]
        preemptions=dict(m.decisions.counts),
        prefix_hit_tokens_cpu=index.hit_tokens_cpu,
        tier_counts=dict(m.store.counts),
        cpu_prefix_cache=m.store.cpu_prefix_cache,
    )


def pool_row(
    pool: int,
    device: str,
    m: KVCacheManager,
    workers: list[str],
    queued: int,
    queued_tokens: int,
    loaded_in: int = 0,
) -> p.PoolRow:
    """One pool's line of the host's stats (``Host`` counts what was routed and the blocks
    loaded in from other pools' CPU tiers; the blocks copied in are its store's ``received``)."""
    gpu = m.pool
    return p.PoolRow(
        pool,
        device,
        p.TierStats(gpu.num_blocks, gpu.num_free, gpu.num_used, gpu.num_cached_free),
        sorted(workers),
        sum(r.status is Status.RUNNING for r in m.requests.values()),
        queued,
        queued_tokens,
        m.index.queried_tokens,
        m.index.hit_tokens,
        m.store.counts["received"],
        loaded_in,
    )


def merge_stats(stats: list[p.Stats], rows: list[p.PoolRow], top: int) -> p.Stats:
    """The host's stats: the pools' ``stats`` summed (their lists joined, the most hit
    prefixes of all, the smallest admission limit, the first pool's calibration) and one
    ``rows`` line per pool."""
    first = stats[0]
    if len(stats) == 1:
        return msgspec.structs.replace(first, pools=rows)

    def tier(parts: list[p.TierStats]) -> p.TierStats:
        fields = p.TierStats.__struct_fields__
        return p.TierStats(*(sum(getattr(t, f) for t in parts) for f in fields))

    prefixes = sorted((row for s in stats for row in s.top_prefixes), key=lambda r: -r.hits)
    return msgspec.structs.replace(
        first,
        admission_limit_blocks=min(s.admission_limit_blocks for s in stats),
        gpu=tier([s.gpu for s in stats]),
        cpu=tier([s.cpu for s in stats]),
        prefix_lookups=sum(s.prefix_lookups for s in stats),
        prefix_queried_tokens=sum(s.prefix_queried_tokens for s in stats),
        prefix_hit_tokens=sum(s.prefix_hit_tokens for s in stats),
        prefix_stops=add_up([s.prefix_stops for s in stats]),
        top_prefixes=prefixes[:top],
        requests=[row for s in stats for row in s.requests],
        workers=[row for s in stats for row in s.workers],
        decisions=sorted((d for s in stats for d in s.decisions), key=lambda d: d.at),
        preemptions=add_up([s.preemptions for s in stats]),
        prefix_hit_tokens_cpu=sum(s.prefix_hit_tokens_cpu for s in stats),
        tier_counts=add_up([s.tier_counts for s in stats]),
        busy_s=add_up([s.busy_s for s in stats]),
        pools=rows,
    )


_CODE = {state: i for i, state in enumerate(p.BLOCK_STATES)}


def block_map(m: KVCacheManager) -> p.BlockMap:
    """One state byte per block of each tier (``p.BLOCK_STATES``)."""
    pool, cpu = m.pool, m.cpu
    running, cached, swapped = _CODE["running"], _CODE["cached"], _CODE["swapped"]
    gpu = bytearray(pool.num_blocks)  # 0 = free
    for block, ref in enumerate(pool.ref_counts):
        if ref:
            gpu[block] = running
        elif pool.cached[block]:
            gpu[block] = cached
    host = bytearray(cpu.num_blocks)
    for r in m.requests.values():
        for block in r.cpu_block_ids:
            host[block] = swapped
    for block in cpu.lru_order():
        host[block] = _CODE["demoted"]
    return p.BlockMap(bytes(gpu), bytes(host))


def block_info(m: KVCacheManager, tier: p.Tier, block: int) -> p.BlockInfo | p.Error:
    """What one block holds; an ``Error`` for a block id outside its tier."""
    size = m.pool.num_blocks if tier == "gpu" else m.cpu.num_blocks
    if not 0 <= block < size:
        return p.Error("bad_message", f"{tier} block {block} outside [0, {size})")
    if tier == "gpu":
        owners = [r.req_id for r in m.requests.values() if block in r.block_ids]
        key = m.index.key_of_block(block)
    else:
        owners = [r.req_id for r in m.requests.values() if block in r.cpu_block_ids]
        key = m.index.key_of_cpu_block(block)
    state = p.BLOCK_STATES[block_map_state(m, tier, block, bool(owners))]
    entry = m.index.entry(key) if key is not None else None
    other = None
    if entry is not None:
        other = entry.cpu_block if tier == "gpu" else entry.block
    return p.BlockInfo(
        tier,
        block,
        state,
        owners,
        key.hex()[:16] if key is not None else None,
        (entry.position + 1) * m.block_size if entry is not None else 0,
        entry.hits if entry is not None else 0,
        other,
    )


def block_map_state(m: KVCacheManager, tier: p.Tier, block: int, owned: bool) -> int:
    if tier == "gpu":
        if m.pool.ref_counts[block]:
            return _CODE["running"]
        return _CODE["cached"] if m.pool.cached[block] else _CODE["free"]
    if owned:
        return _CODE["swapped"]
    return _CODE["demoted"] if m.cpu.is_demoted(block) else _CODE["free"]


def add_up(parts: list[dict[str, Number]]) -> dict[str, Number]:
    """``parts``' values (counts, seconds) summed by key."""
    total: dict[str, Number] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total[key] + value if key in total else value
    return total
