"""``bench/gpu_monitor.summarize``: nvidia-smi samples to one line, exactly."""

from __future__ import annotations

import shutil

import pytest

from bench.gpu_monitor import GpuMonitor, summarize


def test_summarize_counts_power_capped_and_thermal_samples() -> None:
    """Four samples: two at the SW power cap (0x4), one HW thermal (0x40), one free; a header
    line and a blank one are skipped."""
    lines = [
        "clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active",
        "1980, 120.00, 0x0000000000000000",
        "1500, 690.00, 0x0000000000000004",
        "1400, 700.00, 0x0000000000000004",
        "",
        "1700, 650.00, 0x0000000000000040",
    ]
    assert summarize(lines) == (
        "SM clock mean 1,645 MHz (min 1,400), power mean 540 W, power-capped in 50% and "
        "thermally slowed in 25% of 4 samples"
    )
    assert summarize(["N/A, N/A, N/A"]) == "no GPU samples"


def test_a_host_without_nvidia_smi_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with GpuMonitor() as gpu:
        pass
    assert gpu.summary() == "no nvidia-smi: GPU clock and power not sampled"
