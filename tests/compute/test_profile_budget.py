"""The cost-model profile's time budget: which points are measured, in which order, how often.

``measure_points`` runs on a clock of its own here: each ``run`` advances it by what the point
costs (its warm-up and its timed forwards), so the budget's choices are exact; then the real
measurement of the tiny model within budgets of 0 and of no limit.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from transformers import PreTrainedModel

from compute.model.profile import (
    DEFAULT_TOKENS,
    MAX_WORST,
    RECOMPUTE_CONTEXTS,
    RECOMPUTE_TOKENS,
    SHORT_S,
    Budget,
    measure_points,
    measure_profiles,
    unlimited,
)


class Device:
    """A device whose forward of ``n`` costs ``seconds[n]``, on a clock that only it moves."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds = seconds
        self.now = 0.0
        self.runs: list[tuple[int, int]] = []  # (point, timed forwards)

    def clock(self) -> float:
        return self.now

    def run(self, point: int, times: int, left: float) -> float:
        self.runs.append((point, times))
        self.now += (1 + times) * self.seconds[point]  # the warm-up, then the timed forwards
        return self.seconds[point]


def work(n: int) -> float:
    return float(n)


def test_budget_zero_measures_nothing() -> None:
    device = Device({1: 0.001, 2: 0.002})
    budget = Budget(0.0, device.clock)
    assert measure_points([2, 1], work, device.run, budget) == []
    assert device.runs == [] and budget.skipped == [1, 2]


def test_cheapest_first_until_the_next_does_not_fit() -> None:
    """Work 1, 2, 4, 8 seconds-per-forward 1, 2, 4, 8 (proportional: predictions exact); each
    long point costs a warm-up and one timed forward: 2, 4, 8 s, then 16 s does not fit 20."""
    device = Device({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0})
    budget = Budget(20.0, device.clock)
    measured = measure_points([8, 4, 1, 2], work, device.run, budget)
    assert measured == [(1, 1.0), (2, 2.0), (4, 4.0)]
    assert device.runs == [(1, 1), (2, 1), (4, 1)]  # forwards past SHORT_S are timed once
    assert budget.skipped == [8] and device.now == 14.0


def test_a_device_slower_than_its_work_is_predicted_so() -> None:
    """Point 2 costs 4x point 1 for 2x the work: its prediction was 2x short (``worst`` = 2),
    so point 3 (1.5x the work of 2) is predicted at 4 * 1.5 * 2 = 12 s a forward, 24 s with
    its warm-up: more than the 40 - 10 = 30 s left? No: it runs. Point 4 is predicted at
    6 * (4/3) * 2 = 16 s, 32 s in all, past the 40 - 10 - 12 = 18 s left: left out, though
    its true cost (2 * 7 = 14 s) would have fit: the budget is never overrun by a known
    underestimate."""
    device = Device({1: 1.0, 2: 4.0, 3: 6.0, 4: 7.0})
    budget = Budget(40.0, device.clock)
    measured = measure_points([1, 2, 3, 4], work, device.run, budget)
    assert [point for point, _ in measured] == [1, 2, 3]
    assert budget.worst == 2.0 and budget.skipped == [4]


def test_one_point_slowed_down_scales_predictions_by_at_most_max_worst() -> None:
    """Point 2 took 100x its prediction (another process's burst): point 3 is predicted at
    200 * 3/2 * MAX_WORST = 1200 s a forward (2400 s with its warm-up), not 300 * 100."""
    device = Device({1: 1.0, 2: 200.0, 3: 300.0})
    budget = Budget(402.0 + 2400.0, device.clock)  # points 1 and 2 took 402 s
    assert [point for point, _ in measure_points([1, 2, 3], work, device.run, budget)] == [1, 2, 3]
    assert budget.worst == MAX_WORST
    device = Device({1: 1.0, 2: 200.0, 3: 300.0})
    budget = Budget(402.0 + 2400.0 - 1, device.clock)  # 1 s short of it
    assert [point for point, _ in measure_points([1, 2, 3], work, device.run, budget)] == [1, 2]


def test_short_forwards_are_timed_three_times() -> None:
    fast = SHORT_S / 10
    device = Device({1: fast, 2: 2 * fast, 100: 100 * fast})
    budget = Budget(60.0, device.clock)
    measure_points([1, 2, 100], work, device.run, budget)
    # the first point has no prediction: once; the second is predicted short: 3 times; the
    # third, predicted at 100x the first, long: once
    assert device.runs == [(1, 1), (2, 3), (100, 1)]


def test_the_first_point_runs_on_any_budget_above_zero_and_the_rest_stop_when_it_is_spent() -> None:
    device = Device({1: 5.0, 2: 0.001})  # work says 2 is dearer; the device disagrees
    budget = Budget(1.0, device.clock)
    measured = measure_points([1, 2], work, device.run, budget)
    assert measured == [(1, 5.0)] and budget.skipped == [2]  # nothing left after the first


def test_unlimited_measures_every_point_with_the_repeats_asked() -> None:
    device = Device({1: 10.0, 2: 20.0})
    measured = measure_points([2, 1], work, device.run, Budget(math.inf, device.clock), 5)
    assert measured == [(1, 10.0), (2, 20.0)] and device.runs == [(1, 5), (2, 5)]


@pytest.fixture(scope="module")
def tiny() -> PreTrainedModel:
    from compute.model.models import load_model

    model, _ = load_model("tiny", "float32", "cpu")
    return model


def test_tiny_on_cpu_one_eager_grid_serves_both_profiles(tiny: PreTrainedModel) -> None:
    """The grid's points past the model's positions are left out: with 600 (a cheap grid),
    every point is one after no context; the prefill profile is made of the same forwards."""
    tiny.config.max_position_embeddings = 600
    try:
        profiles = measure_profiles(tiny, 16, 2048, unlimited())
    finally:
        tiny.config.max_position_embeddings = 4096
    points = profiles.recompute.points
    zero = sorted(t for t in {*DEFAULT_TOKENS, *RECOMPUTE_TOKENS} if t <= 600)
    assert [(t, c) for t, c, _ in points] == [(t, 0) for t in zero]
    assert min(RECOMPUTE_CONTEXTS[1:]) > 600  # no point after a context fits
    assert profiles.prefill == [(t, s) for t, c, s in points if c == 0]  # the same forwards
    assert profiles.recompute.graph_buckets == [] and profiles.skipped == 0
    assert all(s > 0 for *_, s in points) and profiles.seconds > 0


def test_tiny_with_no_budget_measures_nothing(tiny: PreTrainedModel) -> None:
    profiles = measure_profiles(tiny, 16, 2048, Budget(0.0))
    assert profiles.prefill == [] and profiles.recompute.points == []
    grid = len({*DEFAULT_TOKENS, *RECOMPUTE_TOKENS}) + len(RECOMPUTE_TOKENS)  # 2 contexts
    assert profiles.skipped == grid


def test_a_warm_up_that_leaves_no_room_for_another_forward_is_the_measurement(
    tiny: PreTrainedModel,
) -> None:
    """The real forward, counted: with nothing left after the warm-up, it is the only one."""
    from compute.model.profile import _median_forward, _scratch_pool
    from compute.model.runner import ModelRunner, ScheduledChunk

    runner = ModelRunner(tiny, _scratch_pool(tiny, 16, 64), 16)
    forwards: list[int] = []
    forward = runner.forward

    def counted(chunks: list[ScheduledChunk]) -> Any:
        forwards.append(1)
        return forward(chunks)

    runner.forward = counted  # type: ignore[method-assign,assignment]
    chunk = [ScheduledChunk(list(range(64)), 0, [0, 1, 2, 3])]
    assert _median_forward(runner, chunk, 3, left_s=0.0) > 0 and len(forwards) == 1
    assert _median_forward(runner, chunk, 3) > 0 and len(forwards) == 1 + 4
