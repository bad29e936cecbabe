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
import math
from collections import Counter, deque
from dataclasses import dataclass, field

import msgspec

from kvstore.protocol import DecisionKind, DecisionMode, DecisionRow, PreemptMode

Mode = PreemptMode  # "swap" | "recompute"


@dataclass(frozen=True)
class LinearCost:
    """``seconds(n) = fixed_s + n * per_unit_s``."""

    fixed_s: float
    per_unit_s: float

    def seconds(self, n: float) -> float:
        return self.fixed_s + n * self.per_unit_s

    def units_within(self, seconds: float) -> int | None:
        """The most units done within ``seconds`` (0 if the fixed part alone exceeds them;
        None, no limit, if a unit costs nothing)."""
        if self.per_unit_s <= 0:
            return None if seconds >= self.fixed_s else 0
        return max(int((seconds - self.fixed_s) / self.per_unit_s), 0)


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
    """``predicted_swap_s``: the tier-move side (swap out + in for a preemption, swap-in for a
    prefix load); ``predicted_recompute_s``: the prefill side."""

    mode: DecisionMode
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


def choose_prefix_load(
    load_blocks: int,
    recompute_tokens: int,
    suffix_tokens: int,
    calibration: SwapCalibration | None,
    prefill_profile: list[tuple[int, float]],
) -> Choice:
    """A prefix hit reaches blocks that only the CPU tier holds: load ``load_blocks`` of them
    back (swap-in), or let the worker recompute the ``recompute_tokens`` tokens they (and any
    GPU blocks after them in the chain) cover? The request prefills ``suffix_tokens`` more tokens
    either way, so recomputing costs the *marginal* prefill time ``P(recompute + suffix) -
    P(suffix)`` of the worker's profile ``P``; loading costs the calibrated swap-in line."""
    load_s = calibration.swap_in.seconds(load_blocks) if calibration is not None else None
    recompute_s = None
    if prefill_profile:
        total = interpolate(prefill_profile, recompute_tokens + suffix_tokens)
        base = interpolate(prefill_profile, suffix_tokens) if suffix_tokens else 0.0
        recompute_s = max(total - base, 0.0)
    if load_s is None:
        return Choice("recompute", "no swap calibration", None, recompute_s)
    if recompute_s is None:
        return Choice("load", "no prefill profile from the worker", load_s, None)
    if load_s <= recompute_s:
        return Choice("load", "loading is cheaper", load_s, recompute_s)
    return Choice("recompute", "recompute is cheaper", load_s, recompute_s)


class DecisionLog:
    """The last ``capacity`` decisions plus per-mode totals (owned by the ``KVCacheManager``).
    A decision is kept as the row the stats reply carries (``protocol.DecisionRow``); its
    ``actual_s`` is filled in when the cost is known (swap: out + in, measured by the kvstore;
    recompute: reported by the worker that redid the prefill)."""

    def __init__(self, capacity: int = 256) -> None:
        self._recent: deque[DecisionRow] = deque(maxlen=capacity)
        self._by_id: dict[int, DecisionRow] = {}
        self.counts: Counter[str] = Counter({"swap": 0, "recompute": 0})  # preemptions
        self.prefix_counts: Counter[str] = Counter({"load": 0, "recompute": 0})
        self._next_id = 0

    def record(
        self,
        req_id: str,
        at: float,
        blocks: int,
        tokens: int,
        choice: Choice,
        kind: DecisionKind = "preempt",
    ) -> DecisionRow:
        decision = DecisionRow(
            self._next_id,
            kind,
            req_id,
            at,
            choice.mode,
            choice.reason,
            blocks,
            tokens,
            choice.predicted_swap_s,
            choice.predicted_recompute_s,
            None,
        )
        self._next_id += 1
        if len(self._recent) == self._recent.maxlen:
            self._by_id.pop(self._recent[0].id, None)
        self._recent.append(decision)
        self._by_id[decision.id] = decision
        (self.counts if kind == "preempt" else self.prefix_counts)[choice.mode] += 1
        return decision

    def add_actual(self, decision_id: int, seconds: float) -> None:
        """Adds measured seconds to a decision (swap-out and swap-in arrive separately)."""
        decision = self._by_id.get(decision_id)
        if decision is not None:
            decision.actual_s = (decision.actual_s or 0.0) + seconds

    def recent(self) -> list[dict[str, object]]:
        return [msgspec.structs.asdict(d) for d in self._recent]


# --------------------------------------------------------------------------- recalibration
def fit_nonnegative(
    samples: list[tuple[list[float], float]], floor_s: float | None = 3e-4
) -> list[float]:
    """Least-squares coefficients ``c >= 0`` of ``seconds ~ sum(c[i] * features[i])`` over
    ``(features, seconds)`` samples, weighted by ``1 / max(seconds, floor_s)**2``: relative
    errors down to ``floor_s`` (a 0.5 ms point counts as much as a 50 ms one; a 5 µs one, noise
    next to any move, no more than a 100 µs one); ``floor_s`` None: plain least squares. Exact
    for the few features it is meant for: the best of the unconstrained fits over every subset
    of the features whose coefficients are all non-negative (the rest zero)."""
    if not samples:
        raise ValueError("no samples to fit")
    width = len(samples[0][0])
    weights = [1.0 if floor_s is None else 1.0 / max(y, floor_s) ** 2 for _, y in samples]
    best: tuple[float, list[float]] = (math.inf, [0.0] * width)
    for mask in range(1, 1 << width):
        keep = [i for i in range(width) if mask >> i & 1]
        xs = [[x[i] for i in keep] for x, _ in samples]
        coef = _weighted_lstsq(xs, [y for _, y in samples], weights)
        if coef is None or min(coef) < 0:
            continue
        full = [0.0] * width
        for i, c in zip(keep, coef, strict=True):
            full[i] = c
        err = sum(
            w * (sum(c * f for c, f in zip(full, x, strict=True)) - y) ** 2
            for (x, y), w in zip(samples, weights, strict=True)
        )
        if err < best[0]:
            best = (err, full)
    return best[1]


def _weighted_lstsq(xs: list[list[float]], ys: list[float], ws: list[float]) -> list[float] | None:
    """Solves the normal equations ``(X^T W X) c = X^T W y`` (Gauss-Jordan, partial pivoting);
    None when they are singular."""
    k = len(xs[0])
    a = [
        [sum(w * x[i] * x[j] for x, w in zip(xs, ws, strict=True)) for j in range(k)]
        + [sum(w * x[i] * y for x, y, w in zip(xs, ys, ws, strict=True))]
        for i in range(k)
    ]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        scale = max(abs(a[r][c]) for r in range(k) for c in range(k)) or 1.0
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * p for v, p in zip(a[r], a[col], strict=True)]
    return [a[i][k] / a[i][i] for i in range(k)]


def recompute_features(
    tokens: int, context: int, own_step: bool, linear_tokens: int | None = None
) -> list[float]:
    """Features of the marginal time of recomputing ``tokens`` tokens after ``context`` cached
    ones: what a step of its own costs (``own_step``: the request has at most its last token to
    compute anyway, a decode-shaped chunk, and the recompute turns it into a prefill) and its
    attention reading the context once; the tokens the forward computes (weights, norms, MLPs:
    ``linear_tokens`` where the step is padded to a CUDA graph's size, else ``tokens``); the
    attention the new tokens do, ``tokens * context + tokens**2 / 2`` (a suffix after them adds
    none: it attends to the range on either path)."""
    step = 1.0 if own_step else 0.0
    linear = float(tokens if linear_tokens is None else linear_tokens)
    return [step, step * context, linear, tokens * context + tokens * tokens / 2]


@dataclass
class CostRefit:
    """Online recalibration: prices refitted to measured costs, each falling back to a
    ``prior`` price until it has observations of ``min_points`` distinct sizes. One line per
    ``busy`` state (whether the GPU runs other requests' steps meanwhile: a load then competes
    with them, a recompute rides in their steps):

    - moves (prefix loads' swap-in, a preemption's out + in): a ``fit_linear`` line over blocks;
    - recomputes: ``fit_nonnegative`` over ``recompute_features`` (a step of its own and its
      context read, tokens, attention over the context).

    ``kvstore.pricing`` seeds the recomputes with a worker's startup profile (``(tokens,
    context, seconds)`` of forwards of their own, CUDA graphs included) and observes the
    daemon's measured load times. Fits are cached until the next observation (a refit over 256
    observations takes ~4 ms of Python); observations are the last ``window`` of each kind and
    state."""

    window: int = 256
    min_points: int = 3
    moves: dict[bool, deque[tuple[int, float]]] = field(default_factory=dict)
    recomputes: dict[bool, deque[tuple[int, int, bool, int, float]]] = field(default_factory=dict)
    _fits: dict[tuple[str, bool], list[float] | None] = field(default_factory=dict, repr=False)

    def observe_move(self, blocks: int, busy: bool, seconds: float) -> None:
        self.moves.setdefault(busy, deque(maxlen=self.window)).append((blocks, seconds))
        self._fits.pop(("move", busy), None)

    def observe_recompute(
        self,
        tokens: int,
        context: int,
        busy: bool,
        seconds: float,
        suffix: int = 0,
        linear_tokens: int | None = None,
    ) -> None:
        """``seconds``: the marginal prefill time of recomputing ``tokens`` after ``context``
        (``suffix``: the request's own tokens, prefilled after them on either path; at most 1,
        a step of its own; ``linear_tokens``: see ``recompute_features``)."""
        seen = self.recomputes.setdefault(busy, deque(maxlen=self.window))
        linear = tokens if linear_tokens is None else linear_tokens
        seen.append((tokens, context, suffix <= 1, linear, seconds))
        self._fits.pop(("recompute", busy), None)

    def move_s(self, blocks: int, busy: bool, prior: float) -> float:
        """Seconds to move ``blocks`` blocks (``prior`` until enough was observed)."""
        key = ("move", busy)
        if key not in self._fits:
            seen = self.moves.get(busy, ())
            enough = len({n for n, _ in seen}) >= self.min_points
            line = fit_linear([(float(n), s) for n, s in seen]) if enough else None
            self._fits[key] = [line.fixed_s, line.per_unit_s] if line else None
        coef = self._fits[key]
        return prior if coef is None else coef[0] + coef[1] * blocks

    def recompute_s(
        self,
        tokens: int,
        context: int,
        busy: bool,
        prior: float,
        suffix: int = 0,
        linear_tokens: int | None = None,
    ) -> float:
        """Marginal seconds to recompute ``tokens`` after ``context`` (``prior`` until enough
        was observed; the arguments as ``observe_recompute``'s)."""
        key = ("recompute", busy)
        if key not in self._fits:
            seen = [o for o in self.recomputes.get(busy, ()) if o[-1] > 0]
            enough = len({(t, c) for t, c, *_ in seen}) >= self.min_points
            samples = [(recompute_features(t, c, own, lin), s) for t, c, own, lin, s in seen]
            self._fits[key] = fit_nonnegative(samples) if enough else None
        coef = self._fits[key]
        if coef is None:
            return prior
        x = recompute_features(tokens, context, suffix <= 1, linear_tokens)
        return sum(c * f for c, f in zip(coef, x, strict=True))
