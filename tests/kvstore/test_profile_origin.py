"""The kvstore's prices while a worker's profile is a prior or partial, and where the profile in
force came from (the Register message, Stats, the admin page's body)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from contracts.model_config import KVGeometry
from gateway.admin import cost_model_body, requests_body
from kvstore import protocol as p
from kvstore.cost_model import LinearCost, SwapCalibration, interpolate
from kvstore.device import DevicePools
from kvstore.manager import KVCacheManager
from kvstore.pricing import Pricing
from kvstore.service import KVService

PRIOR = p.ProfileOrigin("prior", 0.0, 0.0, 0)
MEASURED = p.ProfileOrigin("measured", 1_700_000_000.0, 8.5, 2)
CALIBRATION = SwapCalibration(64, LinearCost(1e-4, 1e-6), LinearCost(1e-4, 1e-6))


def prior_pricing(calibration: SwapCalibration | None = CALIBRATION) -> Pricing:
    pricing = Pricing()
    pricing.calibration = calibration
    pricing.register("w", [], [], [], PRIOR)
    return pricing


def test_a_prior_prefers_what_the_kvstore_measured_itself_where_it_can_run() -> None:
    pricing = prior_pricing()
    assert pricing.origins["w"] == PRIOR and "w" not in pricing.prefill_profiles
    swap = pricing.preempt("w", blocks=4, tokens=64, cpu_blocks_free=10)
    assert (swap.mode, swap.reason) == ("swap", "no prefill profile from the worker")
    assert swap.predicted_swap_s == pytest.approx(CALIBRATION.seconds(4))
    assert pricing.preempt("w", 4, 64, cpu_blocks_free=3).mode == "recompute"  # no room: the
    assert pricing.preempt("w", 4, 0, cpu_blocks_free=10).mode == "recompute"  # only choice
    load = pricing.prefix_load("w", 4, 64, 0, 1, running=0)
    assert (load.mode, load.reason) == ("load", "no prefill profile from the worker")
    uncalibrated = prior_pricing(None)
    assert uncalibrated.preempt("w", 4, 64, 10).mode == "recompute"
    assert uncalibrated.prefix_load("w", 4, 64, 0, 1, running=0).mode == "recompute"


def test_a_profile_cut_short_by_its_budget_extrapolates_from_its_last_segment() -> None:
    pricing = Pricing()
    pricing.calibration = CALIBRATION
    pricing.register("w", [(16, 0.01), (64, 0.03)], [], [], MEASURED)
    choice = pricing.preempt("w", blocks=64, tokens=1024, cpu_blocks_free=100)
    slope = (0.03 - 0.01) / 48
    assert choice.predicted_recompute_s == pytest.approx(0.03 + slope * (1024 - 64))
    assert choice.predicted_recompute_s == interpolate([(16, 0.01), (64, 0.03)], 1024)


def test_registering_again_without_a_profile_keeps_the_profile_and_its_origin() -> None:
    pricing = Pricing()
    pricing.register("w", [(16, 0.01)], [(16, 0, 0.01)], [64], MEASURED)
    pricing.register("w", [], [], [], PRIOR)  # e.g. restarted with --profile-budget-s 0
    assert pricing.prefill_profiles["w"] == [(16, 0.01)] and pricing.origins["w"] == MEASURED
    cached = p.ProfileOrigin("cached", 1_700_000_500.0, 8.5, 0)
    pricing.register("w", [(16, 0.02)], [], [], cached)
    assert pricing.prefill_profiles["w"] == [(16, 0.02)] and pricing.origins["w"] == cached


@pytest.fixture
def service() -> Iterator[KVService]:
    pools = DevicePools(KVGeometry(2, 2, 16, "float32"), 16, 16, 8, "cpu")
    manager = KVCacheManager(16, 8, 16)
    yield KVService(manager, pools, lease_timeout_s=60, orphan_grace_s=60)
    pools.close()


def test_register_carries_buckets_and_origin_to_pricing_stats_and_the_admin_page(
    service: KVService,
) -> None:
    register = p.Register("w", [(16, 0.01)], "cpu", 1, [(16, 0, 0.01)], [64, 128], MEASURED)
    assert isinstance(service.handle(register), p.Registered)
    service.handle(p.Register("old-client", [(16, 0.01)], "cpu", 2))  # says nothing of it
    pricing = service.manager.pricing
    assert pricing.graph_buckets["w"] == [64, 128]  # the prices pad to the worker's graphs
    stats = service.handle(p.GetStats(0))
    assert isinstance(stats, p.Stats)
    origins = {row.worker_id: row.profile_origin for row in stats.workers}
    assert origins == {"w": MEASURED, "old-client": None}
    body = cost_model_body(stats)
    assert body["profile_origins"] == {
        "w": {"source": "measured", "measured_at": 1_700_000_000.0, "measure_s": 8.5, "skipped": 2},
        "old-client": None,
    }
    [row] = [w for w in requests_body(stats, 0)["workers"] if w["worker_id"] == "w"]
    assert row["profile_origin"]["source"] == "measured"  # the page's workers table reads it
