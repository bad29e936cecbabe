"""The stats reply: everything the admin API shows, read from the manager without mutating it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore import protocol as p
from kvstore.requests import Status

if TYPE_CHECKING:
    from kvstore.service import KVService


STATUS: dict[Status, p.RequestStatus] = {
    Status.RUNNING: "running",
    Status.SWAPPED: "swapped",
    Status.DROPPED: "dropped",
}


def build_stats(service: KVService, top: int, now: float) -> p.Stats:
    m = service.manager
    pool, swap, index = m.pool, m.swap, m.index
    per_worker: dict[str, int] = {}
    for r in m.requests.values():
        per_worker[r.worker] = per_worker.get(r.worker, 0) + 1
    cal = m.calibration
    return p.Stats(
        block_size=m.block_size,
        block_bytes=service.mover.block_bytes,
        admission_limit_blocks=m.admission_limit_blocks,
        gpu=p.TierStats(pool.num_blocks, pool.num_free, pool.num_used, pool.num_cached_free),
        cpu=p.TierStats(swap.num_blocks, swap.num_free, swap.num_used, 0),
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
                m.prefill_profiles.get(w.worker_id, []),
            )
            for w in service.leases.workers.values()
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
    )
