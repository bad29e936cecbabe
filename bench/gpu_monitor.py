"""The GPU's SM clock, power draw and clock-event reasons, sampled beside a benchmark run.

A long compute-heavy run can hold the GPU at its power limit, where the SM clock drops (the 8B
1000-request run on the H200: 686 W of 700, 1,567 MHz against 1,980; BENCHMARKS-archive.md,
fourteenth pass). A serving figure means little without that state, so ``bench/http_serve.py``
samples it beside every client run: ``with GpuMonitor() as gpu: ...``, then ``gpu.summary()``.

``nvidia-smi`` samples in a child process every ``interval_ms``; without it (a CPU host) the
summary says so.
"""

from __future__ import annotations

import shutil
import subprocess
from types import TracebackType

__all__ = ["GpuMonitor", "summarize"]

QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"
POWER_CAP = 0x4 | 0x80  # clocks_event_reasons: SW power cap, HW power brake slowdown
THERMAL = 0x20 | 0x40  # SW thermal slowdown, HW thermal slowdown


class GpuMonitor:
    def __init__(self, interval_ms: int = 250) -> None:
        self.interval_ms = interval_ms
        self._process: subprocess.Popen[str] | None = None
        self.lines: list[str] = []

    def __enter__(self) -> GpuMonitor:
        if shutil.which("nvidia-smi") is not None:
            command = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
            command += ["-lms", str(self.interval_ms)]
            self._process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._process is None:
            return
        self._process.terminate()
        out, _ = self._process.communicate(timeout=10)
        self.lines = out.splitlines()

    def summary(self) -> str:
        if self._process is None:
            return "no nvidia-smi: GPU clock and power not sampled"
        return summarize(self.lines)


def summarize(lines: list[str]) -> str:
    """One line about ``nvidia-smi`` samples of ``QUERY`` (``csv,noheader,nounits``: "1980,
    123.02, 0x0000000000000000"; every GPU's lines together, lines it cannot read skipped)."""
    samples = []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        try:
            samples.append((float(fields[0]), float(fields[1]), int(fields[2], 16)))
        except (IndexError, ValueError):
            continue
    if not samples:
        return "no GPU samples"
    n = len(samples)
    clocks = [clock for clock, _, _ in samples]
    capped = sum(1 for _, _, reasons in samples if reasons & POWER_CAP)
    hot = sum(1 for _, _, reasons in samples if reasons & THERMAL)
    return (
        f"SM clock mean {sum(clocks) / n:,.0f} MHz (min {min(clocks):,.0f}), power mean "
        f"{sum(p for _, p, _ in samples) / n:.0f} W, power-capped in {100 * capped / n:.0f}% "
        f"and thermally slowed in {100 * hot / n:.0f}% of {n} samples"
    )
