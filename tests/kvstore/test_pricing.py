"""``kvstore.pricing.Pricing``: the prices of a prefix load and of its recompute, exact.

The worker's recompute profile below follows the refit's own form exactly (a step of its own,
the tokens, their attention over the context), so every price is known to the last digit.
"""

from __future__ import annotations

import pytest

from kvstore.cost_model import LinearCost, SwapCalibration, choose_prefix_load
from kvstore.manager import KVCacheManager
from kvstore.pricing import Pricing, padded, step_growth
from kvstore.requests import TransferPlan

STEP_S, TOKEN_S, ATTENTION_S = 1e-3, 1e-5, 1e-9
PREFILL = [(16, 0.01), (64, 0.04), (256, 0.16)]
BUCKETS = [64, 128, 192, 256, 320, 384, 448, 512, 640]  # graphs of prefill steps to 640 tokens


def truth(tokens: int, context: int, own_step: bool = True, linear: int | None = None) -> float:
    """The refit's own form: ``linear`` tokens computed (padded), ``tokens`` attending."""
    attention = tokens * context + tokens * tokens / 2
    computed = tokens if linear is None else linear
    return STEP_S * own_step + TOKEN_S * computed + ATTENTION_S * attention


def profile(buckets: list[int]) -> list[tuple[int, int, float]]:
    """A worker's startup profile: forwards of their own, padded to its graphs."""
    return [
        (t, c, truth(t, c, linear=padded(t, buckets)))
        for c in (0, 2048)
        for t in (16, 64, 256, 1024)
    ]


def priced(buckets: list[int] | None = None) -> Pricing:
    pricing = Pricing()
    pricing.calibration = SwapCalibration(64, LinearCost(0, 0), LinearCost(1e-3, 0))
    pricing.register("w", PREFILL, profile(buckets or []), buckets or [])
    return pricing


def test_padded_and_step_growth() -> None:
    assert [padded(n, BUCKETS) for n in (0, 1, 64, 65, 512, 513, 640, 641)] == [
        0, 64, 64, 128, 512, 640, 640, 641,
    ]  # fmt: skip
    assert step_growth(16, 512, BUCKETS) == 128  # the next graph
    assert step_growth(32, 576, BUCKETS) == 0  # the step's graph had room
    assert step_growth(16, 0, BUCKETS) == 64 and step_growth(16, 0, []) == 16


def test_without_a_recompute_profile_the_prefill_profile_prices_the_recompute_alone() -> None:
    bare = Pricing()
    bare.calibration = SwapCalibration(64, LinearCost(0, 0), LinearCost(1e-3, 0))
    bare.register("w", PREFILL)
    choice = bare.prefix_load("w", 4, 64, 2048, 512, running=0)
    assert choice == choose_prefix_load(4, 64, 0, bare.calibration, PREFILL)
    assert choice.predicted_recompute_s == pytest.approx(0.04)


def test_the_recompute_is_priced_with_its_context_at_the_margin_of_the_requests_step() -> None:
    pricing = priced()
    beside = pricing.prefix_load("w", 4, 64, 2048, 512, running=0)
    assert beside.predicted_recompute_s == pytest.approx(truth(64, 2048, False), rel=1e-6)
    assert beside.predicted_swap_s == 1e-3 and beside.mode == "recompute"  # 0.77 ms < 1 ms
    assert "measured prices" in beside.reason
    # At most its last token to compute: the recompute turns that into a prefill of its own.
    for suffix in (0, 1):
        alone = pricing.prefix_load("w", 4, 64, 2048, suffix, running=0)
        assert alone.predicted_recompute_s == pytest.approx(truth(64, 2048), rel=1e-6)
        assert alone.mode == "load"  # 1.77 ms > 1 ms
    longer = pricing.prefix_load("w", 64, 1024, 0, 512, running=0)  # 10.2 ms + 0.5 ms
    assert longer.predicted_recompute_s == pytest.approx(truth(1024, 0, False), rel=1e-6)
    assert longer.mode == "load"


def test_the_recompute_pays_for_the_graph_its_step_grows_into() -> None:
    pricing = priced(BUCKETS)
    # 512 tokens of its own fill a graph: 16 more run in the 640-token one (128 more).
    grown = pricing.prefix_load("w", 1, 16, 0, 512, running=0)
    assert grown.predicted_recompute_s == pytest.approx(truth(16, 0, False, 128), rel=1e-6)
    assert grown.mode == "load"  # 1.28 ms > 1 ms
    # Beside 64 decodes the step (576 tokens) already runs the 640-token graph: 32 more are
    # free but for their attention.
    free = pricing.prefix_load("w", 2, 32, 0, 512, running=64)
    assert free.predicted_recompute_s == pytest.approx(truth(32, 0, False, 0), rel=1e-6)
    assert free.mode == "recompute"


def test_the_daemons_load_times_replace_the_calibration_after_three_sizes() -> None:
    pricing = priced()
    for blocks in (1, 2):
        pricing.observe_load(blocks, busy=False, seconds=2e-4 + 1e-5 * blocks)
    assert pricing.prefix_load("w", 4, 64, 2048, 512, running=0).predicted_swap_s == 1e-3
    pricing.observe_load(8, busy=False, seconds=2e-4 + 8e-5)
    choice = pricing.prefix_load("w", 4, 64, 2048, 512, running=0)
    assert choice.predicted_swap_s == pytest.approx(2.4e-4) and choice.mode == "load"
    busy = pricing.prefix_load("w", 4, 64, 2048, 512, running=3)  # none timed beside others
    assert busy.predicted_swap_s == 1e-3 and busy.mode == "recompute"
    pricing.observe_load(0, busy=True, seconds=1.0)  # nothing moved: nothing learnt
    assert pricing.loads.moves.get(True) is None


def test_the_manager_prices_with_the_request_context_suffix_and_busy_worker() -> None:
    m = KVCacheManager(6, 4, 16, cpu_prefix_cache=True)
    m.pricing.calibration = SwapCalibration(64, LinearCost(0, 1e-9), LinearCost(1e-3, 0))
    m.pricing.register("w", PREFILL, profile([]))
    prompt = list(range(49))  # 3 full blocks + 1 token
    m.admit("a", "w", prompt, None)
    m.append("a", "w", [], len(prompt))
    m.free("a", "w")
    m.admit("b", "w", list(range(100, 194)), None)  # the whole pool: the 3 blocks demoted
    m.take_pending()
    m.free("b", "w")
    m.check_integrity()
    # The prompt again and 1 token: 48 tokens to recompute beside a 2-token suffix, 0.48 ms
    # against a 1 ms load: recomputed.
    assert m.admit("c", "w", [*prompt, 7], None).num_cached_tokens == 0
    [decision] = m.decisions.recent()
    assert decision["mode"] == "recompute" and decision["predicted_swap_s"] == 1e-3
    assert decision["predicted_recompute_s"] == pytest.approx(truth(48, 0, False), rel=1e-6)
    assert m.take_pending() == TransferPlan() and m.store.counts["recomputed"] == 3
    m.check_integrity()
    m.free("c", "w")
    m.check_integrity()
    # Loads 40x cheaper (the calibration's fixed cost 25 us): the same prefix is loaded now,
    # while "d" runs on the same worker (busy), and its time goes to the busy line.
    m.pricing.calibration = SwapCalibration(64, LinearCost(0, 1e-9), LinearCost(2.5e-5, 0))
    m.admit("d", "w", [50, 51], None)
    placement = m.admit("e", "w", [*prompt, 8], None)
    assert placement.num_cached_tokens == 48
    decision = m.decisions.recent()[-1]
    assert decision["mode"] == "load" and decision["predicted_swap_s"] == 2.5e-5
    plan = m.take_pending()
    assert len(plan.swap_in) == 3
    m.record_transfer(plan, 0.0, 0.002)
    assert list(m.pricing.loads.moves[True]) == [(3, 0.002)] and False not in m.pricing.loads.moves
    m.check_integrity()


def test_the_service_hands_the_workers_graph_sizes_to_the_prices() -> None:
    """``Register.graph_token_buckets`` reach ``Pricing``: a recompute is priced padded to the
    worker's graphs (the real service over real CPU pools)."""
    from contracts.model_config import KVGeometry
    from kvstore import protocol as p
    from kvstore.device import DevicePools
    from kvstore.service import KVService

    pools = DevicePools(KVGeometry(2, 2, 16, "float32"), 16, 16, 8, "cpu")
    try:
        service = KVService(KVCacheManager(16, 8, 16), pools, 60, 60)
        service.handle(p.Register("w", PREFILL, "cpu", 1, profile(BUCKETS), BUCKETS))
        assert service.manager.pricing.graph_buckets["w"] == BUCKETS
    finally:
        pools.close()
