"""The cost model's recalibration: non-negative fits, recompute features, ``CostRefit``."""

from __future__ import annotations

import pytest

from kvstore.cost_model import (
    CostRefit,
    _weighted_lstsq,
    fit_nonnegative,
    recompute_features,
)


def truth(tokens: int, context: int, own_step: bool = True) -> float:
    """A recompute cost with every term of ``recompute_features``: 1 ms a step of its own,
    0.4 µs per context token it reads, 2 µs per token, 1 ns per unit of attention."""
    step = 1e-3 + 4e-7 * context if own_step else 0.0
    return step + 2e-6 * tokens + 1e-9 * (tokens * context + tokens * tokens / 2)


def test_fit_nonnegative_recovers_exact_coefficients() -> None:
    samples = [([1.0, x, x * x], 2 + 3 * x + 0.5 * x * x) for x in (1.0, 2.0, 5.0, 9.0)]
    assert fit_nonnegative(samples) == pytest.approx([2.0, 3.0, 0.5])
    assert fit_nonnegative(samples, floor_s=None) == pytest.approx([2.0, 3.0, 0.5])


def test_fit_nonnegative_drops_a_negative_term_for_the_best_non_negative_subset() -> None:
    samples = [([1.0, 0.0], 2.0), ([1.0, 1.0], 1.0), ([1.0, 2.0], 0.0)]
    # Unconstrained: 2 - x. Constant alone: 1 (squared error 2); x alone: 0.2 x (error 4.8).
    assert fit_nonnegative(samples, floor_s=None) == pytest.approx([1.0, 0.0])
    with pytest.raises(ValueError):
        fit_nonnegative([])


def test_weighted_lstsq_is_none_when_singular() -> None:
    assert _weighted_lstsq([[1.0, 1.0], [2.0, 2.0]], [1.0, 2.0], [1.0, 1.0]) is None
    assert _weighted_lstsq([[1.0], [2.0]], [2.0, 4.0], [1.0, 1.0]) == pytest.approx([2.0])


def test_recompute_features() -> None:
    assert recompute_features(32, 100, True) == [1.0, 100.0, 32.0, 3712.0]  # 32*100 + 32*32/2
    assert recompute_features(32, 100, False) == [0.0, 0.0, 32.0, 3712.0]
    assert recompute_features(16, 0, True) == [1.0, 0.0, 16.0, 128.0]


def test_move_line_falls_back_then_fits_per_busy_state() -> None:
    refit = CostRefit()
    refit.observe_move(1, False, 1e-4 + 1e-5)
    refit.observe_move(4, False, 1e-4 + 4e-5)
    assert refit.move_s(8, False, prior=0.5) == 0.5  # two distinct sizes: not enough
    refit.observe_move(16, False, 1e-4 + 16e-5)
    assert refit.move_s(100, False, prior=0.5) == pytest.approx(1e-4 + 100e-5)
    assert refit.move_s(100, True, prior=0.25) == 0.25  # nothing seen while busy


def test_recompute_is_refitted_exactly_and_cached_until_observed() -> None:
    refit = CostRefit()
    points = [(t, c) for t in (16, 256, 2048) for c in (0, 1024, 4096)]
    for t, c in points[:2]:
        refit.observe_recompute(t, c, False, truth(t, c))
    assert refit.recompute_s(512, 512, False, prior=9.0) == 9.0  # two points: the prior
    for t, c in points[2:]:
        refit.observe_recompute(t, c, False, truth(t, c))
    assert refit.recompute_s(8192, 8192, False, prior=9.0) == pytest.approx(truth(8192, 8192))
    # a suffix prefilled either way: no step of its own, only the tokens and their attention
    got = refit.recompute_s(64, 2048, False, prior=9.0, suffix=100)
    assert got == pytest.approx(truth(64, 2048, own_step=False))
    assert refit.recompute_s(64, 2048, True, prior=7.0) == 7.0  # busy: a line of its own
    refit.observe_recompute(16, 0, False, 1.0)  # an outlier: the cached fit is dropped
    assert refit.recompute_s(8192, 8192, False, prior=9.0) != pytest.approx(truth(8192, 8192))


def test_window_keeps_the_last_observations() -> None:
    refit = CostRefit(window=3)
    for n in (1, 2, 3):
        refit.observe_move(n, False, 1.0 * n)  # 1 s a block: forgotten below
    for n in (4, 5, 6):
        refit.observe_move(n, False, 0.5 * n)
    assert refit.move_s(10, False, prior=0.0) == pytest.approx(5.0)
