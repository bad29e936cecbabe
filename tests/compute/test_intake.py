"""``Intake.gone``: which gateways have been missing long enough for their requests to end
(pure bookkeeping over the times given; the engine's end of their requests is tested through
real gateways in ``tests/test_up_gateways.py``)."""

from __future__ import annotations

from compute.admission import ModelLimits
from compute.faults import Faults
from compute.intake import GATEWAY_MISSING_S, Intake


def intake() -> Intake:
    """No Redis and no requests are touched by ``gone``."""
    return Intake(
        None,  # type: ignore[arg-type]
        "w",
        1000,
        None,  # type: ignore[arg-type]
        lambda seq_ids: None,
        Faults(),
        ModelLimits(1, 1),
    )


def test_a_gateway_is_gone_once_missing_for_the_grace_period_and_only_once() -> None:
    watch = intake()
    assert watch.gone({"g1"}, now=100.0) == []  # first miss: maybe a Redis restart
    assert watch.gone({"g1", "g2"}, now=100.0 + GATEWAY_MISSING_S - 0.5) == []
    assert watch.gone({"g1", "g2"}, now=100.0 + GATEWAY_MISSING_S) == ["g1"]
    assert watch.gone({"g1", "g2"}, now=100.0 + GATEWAY_MISSING_S + 0.5) == []  # g1 re-armed
    # g2 was first missed 0.5 s before g1 went, g1 again 0.5 s after
    assert watch.gone({"g1", "g2"}, now=100.0 + 2 * GATEWAY_MISSING_S) == ["g2"]
    assert watch.gone({"g1"}, now=100.0 + 2 * GATEWAY_MISSING_S + 0.5) == ["g1"]


def test_a_gateway_seen_again_starts_its_grace_period_over() -> None:
    watch = intake()
    assert watch.gone({"g"}, now=0.0) == []
    assert watch.gone(set(), now=GATEWAY_MISSING_S - 1) == []  # its key is back
    assert watch.gone({"g"}, now=GATEWAY_MISSING_S) == []  # missing again: a new first miss
    assert watch.gone({"g"}, now=2 * GATEWAY_MISSING_S - 0.5) == []
    assert watch.gone({"g"}, now=2 * GATEWAY_MISSING_S) == ["g"]
