"""The prefill profile a worker registers with, and the kvstore's cost model reading it."""

from __future__ import annotations

from compute.model.models import load_model
from compute.model.profile import measure_prefill
from kvstore.cost_model import interpolate


def test_prefill_profile_grows_with_tokens_and_feeds_the_cost_model() -> None:
    model, _ = load_model("tiny", "float32", "cpu")
    profile = measure_prefill(model, block_size=16, token_counts=(16, 1024), repeats=3)
    assert [tokens for tokens, _ in profile] == [16, 1024]
    (_, short), (_, long) = profile
    assert 0 < short < long, profile  # 64x the tokens (quadratic attention) cannot be cheaper
    assert short < interpolate(profile, 100) < long


def test_recompute_profile_times_chunks_after_a_context_and_feeds_the_pricing() -> None:
    """Forwards after a cached context cost more than from an empty one; pairs past the
    model's positions are left out; on CPU there are no graphs. ``Pricing`` fits the points."""
    from compute.model.profile import measure_recompute
    from kvstore.cost_model import LinearCost, SwapCalibration
    from kvstore.pricing import Pricing

    model, _ = load_model("tiny", "float32", "cpu")
    limit = model.config.max_position_embeddings
    profile = measure_recompute(
        model, block_size=16, token_counts=(16, 1024), contexts=(0, limit - 512), repeats=3
    )
    assert [(t, c) for t, c, _ in profile.points] == [(16, 0), (1024, 0), (16, limit - 512)]
    assert profile.graph_buckets == []  # eager on CPU
    seconds = {(t, c): s for t, c, s in profile.points}
    assert 0 < seconds[16, 0] < seconds[1024, 0]
    pricing = Pricing()
    pricing.calibration = SwapCalibration(64, LinearCost(0, 0), LinearCost(1.0, 0))  # 1 s loads
    pricing.register("w", [(16, 0.01)], profile.points, profile.graph_buckets)
    choice = pricing.prefix_load("w", 4, 64, 0, 1, running=0)
    assert choice.mode == "recompute" and "measured prices" in choice.reason
    assert 0 < choice.predicted_recompute_s <= seconds[1024, 0]  # type: ignore[operator]
