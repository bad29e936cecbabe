"""The engine's timeline log line (``compute.loop.timeline``)."""

from __future__ import annotations

from compute.loop.timeline import TimelineLog


def test_a_line_every_period_with_per_step_averages_of_the_counters_growth() -> None:
    log = TimelineLog(every_s=10.0)
    assert log.tick({"launch": 1.0, "process": 2.0}, 100, 5000, 3.0, now=0.0) is None  # baseline
    assert log.tick({"launch": 1.5, "process": 2.5}, 200, 9000, 3.4, now=5.0) is None  # too early
    line = log.tick({"launch": 2.0, "process": 2.8, "wait": 0.4}, 600, 25000, 4.0, now=10.0)
    assert line == (
        "50 steps/s, 2000 tokens/s computed; ms per step: launch 2.00, process 1.60, "
        "wait 0.80, device 2.00"
    )
    assert log.tick({"launch": 2.0}, 600, 25000, 4.0, now=25.0) is None  # no step: no line
    assert log.tick({"launch": 0.1}, 10, 100, 0.0, now=40.0) is None  # restarted: a new base


def test_the_line_says_in_how_many_steps_prompts_were_held_back() -> None:
    log = TimelineLog(every_s=10.0)
    assert log.tick({"launch": 1.0}, 100, 5000, 1.0, now=0.0, held=7) is None
    line = log.tick({"launch": 1.2}, 200, 9000, 1.5, now=10.0, held=67)
    assert line == (
        "10 steps/s, 400 tokens/s computed; ms per step: launch 2.00, device 5.00; "
        "prompts held back in 60 of 100 steps"
    )
    assert log.tick({"launch": 1.4}, 300, 9900, 2.0, now=20.0, held=67) == (
        "10 steps/s, 90 tokens/s computed; ms per step: launch 2.00, device 5.00"
    )


def test_path_totals_count_steps_device_seconds_and_tokens_per_path() -> None:
    from compute.loop.timeline import PathTotals

    totals = PathTotals()
    totals.add("decode_graph", 0.002, 128)
    totals.add("mixed_graph", 0.010, 900)
    totals.add("decode_graph", 0.003, 120)
    assert totals.totals == {"decode_graph": (2, 0.005, 248), "mixed_graph": (1, 0.010, 900)}
