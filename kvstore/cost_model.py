"""Swap-vs-recompute cost model: pure functions over measured numbers, and the decision log.

- Swap cost of ``n`` blocks = measured swap-out time + measured swap-in time, each a line
  ``fixed + n * per_block`` fitted to the kvstore's own startup timings of this pool's blocks.
- Recompute cost of ``t`` tokens = the prefill time a compute worker measured at a few token counts
  and reported when it registered, interpolated piecewise-linearly (extrapolated from the last
  segment's slope).
The cheaper wins; a swap also needs room in the CPU tier. Every decision is recorded with both
predictions and, once known, the actual cost.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from dataclasses import asdict, dataclass, field

from kvstore.protocol import PreemptMode

Mode = PreemptMode  # "swap" | "recompute"


@dataclass(frozen=True)
class LinearCost:
    """``seconds(n) = fixed_s + n * per_unit_s``."""

    fixed_s: float
    per_unit_s: float

    def seconds(self, n: float) -> float:
        return self.fixed_s + n * self.per_unit_s


def fit_linear(samples: list[tuple[float, float]]) -> LinearCost:
    """Least-squares line through ``(n, seconds)`` samples, clamped to non-negative terms."""
    if not samples:
        raise ValueError("no samples to fit")
    xs = [float(x) for x, _ in samples]
    ys = [float(y) for _, y in samples]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    if var == 0:
        return LinearCost(0.0, max(mean_y / max(mean_x, 1.0), 0.0))
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    slope = max(slope, 0.0)
    return LinearCost(max(mean_y - slope * mean_x, 0.0), slope)


@dataclass(frozen=True)
class SwapCalibration:
    """The kvstore's startup measurement of moving this pool's blocks to and from the CPU tier."""

    block_bytes: int
    swap_out: LinearCost  # seconds for n blocks GPU -> CPU
    swap_in: LinearCost  # seconds for n blocks CPU -> GPU
    samples: list[tuple[int, float, float]] = field(default_factory=list)  # (n, out_s, in_s)

    def seconds(self, num_blocks: int) -> float:
        return self.swap_out.seconds(num_blocks) + self.swap_in.seconds(num_blocks)

    def bandwidth_gbps(self) -> tuple[float, float]:
        """Asymptotic GB/s of swap-out and swap-in (block bytes over per-block time)."""

        def gbps(cost: LinearCost) -> float:
            return self.block_bytes / cost.per_unit_s / 1e9 if cost.per_unit_s > 0 else float("inf")

        return gbps(self.swap_out), gbps(self.swap_in)


def interpolate(profile: list[tuple[int, float]], tokens: int) -> float:
    """Prefill seconds for ``tokens`` from measured ``(tokens, seconds)`` points, piecewise linear;
    below the first point it scales through the origin, past the last one it follows the last
    segment's slope."""
    if not profile:
        raise ValueError("empty prefill profile")
    points = sorted(profile)
    xs = [x for x, _ in points]
    if len(points) == 1 or tokens <= xs[0]:
        x0, y0 = points[0]
        return y0 * tokens / x0 if x0 > 0 else y0
    i = min(bisect.bisect_left(xs, tokens), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


@dataclass(frozen=True)
class Choice:
    mode: Mode
    reason: str
    predicted_swap_s: float | None
    predicted_recompute_s: float | None


def choose(
    num_blocks: int,
    num_tokens: int,
    calibration: SwapCalibration | None,
    prefill_profile: list[tuple[int, float]],
    cpu_blocks_free: int,
) -> Choice:
    """Swap or recompute a victim holding ``num_blocks`` blocks with ``num_tokens`` computed."""
    swap_s = calibration.seconds(num_blocks) if calibration is not None else None
    recompute_s = interpolate(prefill_profile, num_tokens) if prefill_profile else None
    if num_tokens == 0:
        return Choice("recompute", "nothing computed yet", swap_s, 0.0)
    if calibration is None or cpu_blocks_free < num_blocks:
        why = "no swap calibration" if calibration is None else "CPU tier full"
        return Choice("recompute", why, swap_s, recompute_s)
    if recompute_s is None:
        return Choice("swap", "no prefill profile from the worker", swap_s, None)
    assert swap_s is not None
    if swap_s <= recompute_s:
        return Choice("swap", "swap is cheaper", swap_s, recompute_s)
    return Choice("recompute", "recompute is cheaper", swap_s, recompute_s)


@dataclass
class Decision:
    """One preemption, as decided; ``actual_s`` is filled in when the cost is known (swap: out +
    in, measured by the kvstore; recompute: reported by the worker that redid the prefill)."""

    id: int
    req_id: str
    at: float
    mode: Mode
    reason: str
    blocks: int
    tokens: int
    predicted_swap_s: float | None
    predicted_recompute_s: float | None
    actual_s: float | None = None

    @property
    def predicted_s(self) -> float | None:
        return self.predicted_swap_s if self.mode == "swap" else self.predicted_recompute_s


class DecisionLog:
    """The last ``capacity`` decisions plus per-mode totals (owned by the ``KVCacheManager``)."""

    def __init__(self, capacity: int = 256) -> None:
        self._recent: deque[Decision] = deque(maxlen=capacity)
        self._by_id: dict[int, Decision] = {}
        self.counts: Counter[str] = Counter({"swap": 0, "recompute": 0})
        self._next_id = 0

    def record(self, req_id: str, at: float, blocks: int, tokens: int, choice: Choice) -> Decision:
        decision = Decision(
            self._next_id,
            req_id,
            at,
            choice.mode,
            choice.reason,
            blocks,
            tokens,
            choice.predicted_swap_s,
            choice.predicted_recompute_s,
        )
        self._next_id += 1
        if len(self._recent) == self._recent.maxlen:
            self._by_id.pop(self._recent[0].id, None)
        self._recent.append(decision)
        self._by_id[decision.id] = decision
        self.counts[choice.mode] += 1
        return decision

    def add_actual(self, decision_id: int, seconds: float) -> None:
        """Adds measured seconds to a decision (swap-out and swap-in arrive separately)."""
        decision = self._by_id.get(decision_id)
        if decision is not None:
            decision.actual_s = (decision.actual_s or 0.0) + seconds

    def recent(self) -> list[dict[str, object]]:
        return [asdict(d) for d in self._recent]
