"""``bench/device_window.report``: span, busy union and gaps of device activities, exactly."""

from __future__ import annotations

from bench.device_window import report


def test_report_counts_overlaps_once_and_names_the_gaps() -> None:
    """a [0, 1000) us and b [500, 2000) overlap: busy 2 ms; c starts at 3000: a 1 ms gap after
    b; d [3500, 4000) lies inside c [3000, 5000): span 5 ms, busy 4 ms, one gap."""
    spans = [(3000.0, 5000.0, "c"), (0.0, 1000.0, "a"), (500.0, 2000.0, "b"), (3500, 4000, "d")]
    lines = report(spans, 0.0042, 3)
    assert lines[0] == (
        "device window of 3 steps: span 5.00 ms, busy 4.00 ms (80.0%), idle 1.00 ms in 1 gaps; "
        "the engine's device time for the steps processed meanwhile 4.20 ms"
    )
    assert lines[1] == "  gap   1.000 ms after b before c"
    assert lines[2].split() == ["2.000", "ms", "x1", "c"]  # the busiest name first
    assert [line.split()[-1] for line in lines[2:]] == ["c", "b", "a", "d"]


def test_report_of_nothing_says_so() -> None:
    assert report([], 0.0, 5) == ["device window: no device activity recorded"]
