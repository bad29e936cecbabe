"""The prefill profile a worker registers with, and the kvstore's cost model reading it."""

from __future__ import annotations

from compute.models import load_model
from compute.profile import measure_prefill
from kvstore.cost_model import interpolate


def test_prefill_profile_grows_with_tokens_and_feeds_the_cost_model() -> None:
    model, _ = load_model("tiny", "float32", "cpu")
    profile = measure_prefill(model, block_size=16, token_counts=(16, 1024), repeats=3)
    assert [tokens for tokens, _ in profile] == [16, 1024]
    (_, short), (_, long) = profile
    assert 0 < short < long, profile  # 64x the tokens (quadratic attention) cannot be cheaper
    assert short < interpolate(profile, 100) < long
