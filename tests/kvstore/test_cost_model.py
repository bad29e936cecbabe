"""The swap-vs-recompute cost model: fits, interpolation, choices and the decision log."""

from __future__ import annotations

import pytest

from kvstore.cost_model import (
    DecisionLog,
    LinearCost,
    SwapCalibration,
    choose,
    fit_linear,
    interpolate,
)


def test_fit_linear_recovers_fixed_and_per_unit_cost() -> None:
    fit = fit_linear([(n, 2e-5 + n * 1e-5) for n in (1, 4, 16, 64)])
    assert fit.fixed_s == pytest.approx(2e-5) and fit.per_unit_s == pytest.approx(1e-5)
    assert fit_linear([(4, 8.0)]) == LinearCost(0.0, 2.0)
    assert fit_linear([(1, 5.0), (2, 1.0)]).per_unit_s == 0.0  # never a negative slope


def test_units_within_a_time_budget() -> None:
    """The demotion budget's arithmetic: (budget - fixed) / per unit, never negative; a line
    whose units cost nothing limits nothing once its fixed part fits."""
    line = LinearCost(1e-3, 0.25e-3)
    assert [line.units_within(s) for s in (5e-3, 1.2e-3, 1e-3, 0.5e-3, 0.0)] == [16, 0, 0, 0, 0]
    assert line.units_within(1.25e-3) == 1
    assert LinearCost(1e-3, 0.0).units_within(2e-3) is None
    assert LinearCost(1e-3, 0.0).units_within(0.5e-3) == 0


def test_interpolate_prefill_profile() -> None:
    profile = [(1024, 0.1), (16, 0.01), (256, 0.03)]
    assert interpolate(profile, 16) == pytest.approx(0.01)
    assert interpolate(profile, 136) == pytest.approx(0.02)  # halfway between 16 and 256
    assert interpolate(profile, 8) == pytest.approx(0.005)  # through the origin below the first
    assert interpolate(profile, 2048) == pytest.approx(0.1 + 1024 * 0.07 / 768)  # last slope


def test_choose_takes_the_cheaper_and_respects_cpu_room() -> None:
    cal = SwapCalibration(1 << 20, LinearCost(1e-4, 1e-4), LinearCost(1e-4, 1e-4))
    profile = [(16, 0.001), (4096, 0.2)]
    # 10 blocks: swap 2 * (1e-4 + 1e-3) = 2.2 ms; 160 tokens recompute ~ 8 ms.
    assert choose(10, 160, cal, profile, cpu_blocks_free=100).mode == "swap"
    assert choose(10, 160, cal, profile, cpu_blocks_free=9).reason == "CPU tier full"
    cheap = [(16, 1e-5), (4096, 1e-4)]
    picked = choose(10, 160, cal, cheap, cpu_blocks_free=100)
    assert (picked.mode, picked.reason) == ("recompute", "recompute is cheaper")
    assert picked.predicted_swap_s == pytest.approx(2.2e-3)
    assert choose(10, 160, None, profile, 100).reason == "no swap calibration"
    assert choose(10, 160, cal, [], 100).mode == "swap"
    assert choose(1, 0, cal, profile, 100).mode == "recompute"


def test_decision_log_records_actuals_and_stays_bounded() -> None:
    log = DecisionLog(capacity=2)
    cal = SwapCalibration(1024, LinearCost(0, 1e-3), LinearCost(0, 1e-3))
    ids = [log.record(f"r{i}", float(i), 4, 64, choose(4, 64, cal, [], 10)).id for i in range(3)]
    log.add_actual(ids[2], 0.004)
    log.add_actual(ids[2], 0.003)  # swap-in arrives after swap-out
    log.add_actual(ids[0], 1.0)  # fell out of the window: ignored
    recent = log.recent()
    assert [d["req_id"] for d in recent] == ["r1", "r2"]
    assert recent[1]["actual_s"] == pytest.approx(0.007) and recent[0]["actual_s"] is None
    assert log.counts["swap"] == 3
