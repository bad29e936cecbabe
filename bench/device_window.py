"""The device's timeline over a window of engine steps: busy, idle, and where the time goes.

``DeviceWindow(first, count)`` records ``count`` engine steps from step ``first`` with the torch
profiler (CUDA activity: kernels, copies, memsets, graph replays included) and prints

- the window's span on the device (first activity to last) and how much of it something ran;
- the engine's own count of device time for the steps processed in the window (the CUDA
  events around each step, ``compute.loop.model_step``), to compare with the span;
- the longest idle gaps, with the activities on either side;
- the device time per activity name.

It answers "does the device wait for the host, and between which kernels" for a real run,
where ``bench/decode_step.py`` times one graph replay alone. Used by ``bench/serve.py
--device-window FIRST:COUNT``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["DeviceWindow", "report"]


class DeviceWindow:
    """Start/stop a profiler around engine steps [``first``, ``first + count``)."""

    def __init__(self, first: int, count: int, out: Callable[[str], None] = print) -> None:
        self.first, self.count, self.out = first, count, out
        self._profile: Any = None
        self._device_s = 0.0

    def before_step(self, step: int, device_s: float) -> None:
        """Call before engine step ``step`` (0-based) with the engine's device seconds so far."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        if step == self.first:
            torch.cuda.synchronize()
            self._device_s = device_s
            self._profile = profile(activities=[ProfilerActivity.CUDA])
            self._profile.__enter__()
        elif step == self.first + self.count:
            self.finish(step, device_s)

    def finish(self, step: int, device_s: float) -> None:
        """Stops the profiler, if it runs, and reports the steps from ``first`` to ``step`` (a
        run that ends inside the window reports what it ran)."""
        import torch

        if self._profile is None:
            return
        torch.cuda.synchronize()
        self._profile.__exit__(None, None, None)
        spans = [
            (e.time_range.start, e.time_range.end, e.name)
            for e in self._profile.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
        ]
        for line in report(spans, device_s - self._device_s, step - self.first):
            self.out(line)
        self._profile = None


def report(spans: list[tuple[float, float, str]], engine_s: float, steps: int) -> list[str]:
    """Lines about device activities ``spans`` (start us, end us, name): span, busy union,
    idle gaps, time per name; ``engine_s``: the engine's device seconds over the same steps."""
    if not spans:
        return ["device window: no device activity recorded"]
    spans = sorted(spans)
    begin, end = spans[0][0], max(s[1] for s in spans)
    busy = 0.0
    gaps: list[tuple[float, str, str]] = []
    run_start, run_end, last_name = spans[0][0], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > run_end:
            busy += run_end - run_start
            gaps.append((start - run_end, last_name, name))
            run_start = start
        if stop >= run_end:
            run_end, last_name = stop, name
    busy += run_end - run_start
    span_ms, busy_ms = (end - begin) / 1e3, busy / 1e3
    lines = [
        f"device window of {steps} steps: span {span_ms:.2f} ms, busy {busy_ms:.2f} ms "
        f"({100 * busy_ms / span_ms:.1f}%), idle {span_ms - busy_ms:.2f} ms in {len(gaps)} gaps; "
        f"the engine's device time for the steps processed meanwhile {engine_s * 1e3:.2f} ms"
    ]
    gaps.sort(reverse=True)
    for gap_us, before, after in gaps[:12]:
        lines.append(f"  gap {gap_us / 1e3:7.3f} ms after {before[:60]} before {after[:60]}")
    per_name: dict[str, list[float]] = {}
    for start, stop, name in spans:
        per_name.setdefault(name, []).append((stop - start) / 1e3)
    for name, times in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:25]:
        lines.append(f"  {sum(times):9.3f} ms x{len(times):<5d} {name[:100]}")
    return lines
