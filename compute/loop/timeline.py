"""The engine's per-step timeline in the worker's log: ``TimelineLog``. Pure Python.

Every ``every_s`` while the engine works, one line: steps and computed tokens per second, then
per step the host milliseconds of each phase of ``Engine.phases()`` (``launch`` = ``plan`` +
``forward`` + ``draw``; ``process`` includes ``wait``, the host waiting for the device;
``kvstore`` includes ``kv_wait``, the wait for the kvstore's reply; ``launch`` includes
``compile``, Triton kernel variants built after start-up) and the
device milliseconds (CUDA events around each step's device work), and how many of the steps held
their prompts back (``--prefill-interval``), when any did. When ``wait`` is large and the
device time is close to the step time, the device is the bottleneck; when the host phases add up
to more than the device time, the host is.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["PathTotals", "TimelineLog"]


@dataclass
class PathTotals:
    """Processed steps, their device seconds and computed tokens, per way a forward ran
    (``compute.model.runner.ForwardPath``): where the device time goes, decode graphs against
    mixed-step graphs against eager forwards. Counters."""

    totals: dict[str, tuple[int, float, int]] = field(default_factory=dict)

    def add(self, path: str, device_s: float, tokens: int) -> None:
        steps, seconds, computed = self.totals.get(path, (0, 0.0, 0))
        self.totals[path] = (steps + 1, seconds + device_s, computed + tokens)


@dataclass(frozen=True)
class _Snapshot:
    at: float
    phase_s: dict[str, float]
    steps: int
    tokens: int
    device_s: float
    held: int


class TimelineLog:
    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last: _Snapshot | None = None

    def tick(
        self,
        phase_s: Mapping[str, float],
        steps: int,
        tokens: int,
        device_s: float,
        now: float | None = None,
        held: int = 0,
    ) -> str | None:
        """The line to log now, or None (too early, or no step since the last line). The
        counters are the engine's running totals (``held``: the scheduler's ``held_steps``)."""
        at = time.monotonic() if now is None else now
        snapshot = _Snapshot(at, dict(phase_s), steps, tokens, device_s, held)
        last = self._last
        if last is None or snapshot.steps < last.steps:  # the first call, or the engine restarted
            self._last = snapshot
            return None
        elapsed = snapshot.at - last.at
        n = snapshot.steps - last.steps
        if elapsed < self.every_s:
            return None
        self._last = snapshot
        if n == 0:
            return None
        per_step = ", ".join(
            f"{name} {1e3 * (seconds - last.phase_s.get(name, 0.0)) / n:.2f}"
            for name, seconds in snapshot.phase_s.items()
        )
        held_back = snapshot.held - last.held
        return (
            f"{n / elapsed:.0f} steps/s, {max(snapshot.tokens - last.tokens, 0) / elapsed:.0f} "
            f"tokens/s computed; ms per step: {per_step}, device "
            f"{1e3 * max(snapshot.device_s - last.device_s, 0.0) / n:.2f}"
            + (f"; prompts held back in {held_back} of {n} steps" if held_back > 0 else "")
        )
