"""The cost sweep's points and their scores: how often the faster path was chosen, the time lost
against an oracle that always takes it, the tables ``bench/cost_sweep.py`` prints."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import product

from bench.cost_rig import BLOCK
from kvstore.cost_model import Choice, CostRefit

KINDS = ("prefix", "preempt", "peer")


@dataclass(frozen=True)
class Row:
    """One grid point: predictions, actual medians (seconds) and the model's choice."""

    kind: str  # "prefix" (load vs recompute) | "preempt" (swap out + in vs recompute from 0)
    # | "peer" (copy from another GPU's pool vs recompute)
    batch: str  # "absent" | "present"
    context: int  # tokens cached before the range (preempt: 0)
    blocks: int
    predicted_move_s: float  # swap-in (preempt: out + in)
    predicted_recompute_s: float
    move_s: float
    recompute_s: float
    chosen: str  # "move" | "recompute"
    suffix: int = 0  # the request's own tokens after the range (preempt: 0)

    @classmethod
    def of(cls, kind: str, batch: str, context: int, n: int, suffix: int, choice: Choice,
           move: float, rec: float) -> Row:  # fmt: skip
        pred_move, pred_rec = choice.predicted_swap_s, choice.predicted_recompute_s
        chosen = "recompute" if choice.mode == "recompute" else "move"
        inf = math.inf  # no calibration, no profile: that side is never chosen
        return cls(kind, batch, context, n, inf if pred_move is None else pred_move,
                   inf if pred_rec is None else pred_rec, move, rec, chosen, suffix)  # fmt: skip

    def rechosen(self, refit: CostRefit) -> Row:
        """This point chosen by ``refit``'s prices (the startup model's where it has none)."""
        busy, tokens = self.batch == "present", self.blocks * BLOCK
        move = refit.move_s(self.blocks, busy, self.predicted_move_s)
        rec = refit.recompute_s(tokens, self.context, busy, self.predicted_recompute_s, self.suffix)
        chosen = "move" if move <= rec else "recompute"
        return replace(self, predicted_move_s=move, predicted_recompute_s=rec, chosen=chosen)

    @property
    def faster(self) -> str:
        return "move" if self.move_s <= self.recompute_s else "recompute"

    @property
    def oracle_s(self) -> float:
        return min(self.move_s, self.recompute_s)

    @property
    def lost_s(self) -> float:
        return (self.move_s if self.chosen == "move" else self.recompute_s) - self.oracle_s


@dataclass(frozen=True)
class Score:
    points: int
    right: int  # the chosen path was the faster one (a tie counts as right)
    lost_s: float
    oracle_s: float
    worst: list[Row]
    move_ratio: tuple[float, float, float]  # predicted / actual: min, median, max
    recompute_ratio: tuple[float, float, float]

    @property
    def right_pct(self) -> float:
        return 100.0 * self.right / self.points if self.points else 0.0

    @property
    def lost_pct(self) -> float:
        return 100.0 * self.lost_s / self.oracle_s if self.oracle_s else 0.0

    @property
    def met(self) -> bool:
        return self.right_pct >= 95.0 and self.lost_pct <= 5.0


def score(rows: Sequence[Row], worst: int = 5) -> Score:
    def spread(pairs: list[tuple[float, float]]) -> tuple[float, float, float]:
        ratios = sorted(p / a for p, a in pairs if a > 0) or [math.nan]
        return ratios[0], statistics.median(ratios), ratios[-1]

    misses = sorted((r for r in rows if r.lost_s > 0), key=lambda r: -r.lost_s)[:worst]
    moves = spread([(r.predicted_move_s, r.move_s) for r in rows])
    recomputes = spread([(r.predicted_recompute_s, r.recompute_s) for r in rows])
    lost, oracle = sum(r.lost_s for r in rows), sum(r.oracle_s for r in rows)
    return Score(len(rows), sum(r.lost_s == 0 for r in rows), lost, oracle, misses, moves,
                 recomputes)  # fmt: skip


def report(rows: Sequence[Row], title: str, table: bool = True) -> list[str]:
    """A table of the points (``table``; else of the misses only), summaries by kind, batch and
    suffix, the worst misses, and the points closest to flipping."""
    shown = list(rows) if table else [r for r in rows if r.lost_s > 0]
    lines = [f"## {title}", ""]
    if shown:
        lines += [
            "| kind | batch | context | suffix | blocks | pred move ms | move ms | "
            "pred recompute ms | recompute ms | chosen | faster | lost ms |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|",
        ]
    for r in shown:
        lines.append(
            f"| {r.kind} | {r.batch} | {r.context} | {r.suffix} | {r.blocks} | "
            f"{ms(r.predicted_move_s)} | {ms(r.move_s)} | {ms(r.predicted_recompute_s)} | "
            f"{ms(r.recompute_s)} | {r.chosen} | {r.faster} | {ms(r.lost_s)} |"
        )
    lines.append("")
    suffixes = sorted({r.suffix for r in rows})
    groups = ["all", "absent", "present", *(f"suffix {s}" for s in suffixes if len(suffixes) > 1)]
    for kind, group in product(KINDS, groups):
        subset = [
            r for r in rows if r.kind == kind and group in ("all", r.batch, f"suffix {r.suffix}")
        ]
        if subset:
            lines.append(summary_line(f"{kind} {group}", score(subset)))
    for r in score([r for r in rows if r.kind == "prefix"]).worst:
        lines.append(
            f"  worst prefix miss: {where(r)}: chose {r.chosen}, lost {ms(r.lost_s)} ms of "
            f"{ms(r.oracle_s)} ms"
        )
    for kind in KINDS:  # how far the actual costs were from flipping the answer
        close = min((r for r in rows if r.kind == kind and r.oracle_s > 0), default=None,
                    key=lambda r: max(r.move_s, r.recompute_s) / r.oracle_s)  # fmt: skip
        if close is not None:
            slower = max(close.move_s, close.recompute_s) / close.oracle_s
            lines.append(f"  closest {kind} point: {where(close)}: the slower path {slower:.2f}x")
    return lines


def where(r: Row) -> str:
    return f"{r.batch} context {r.context} suffix {r.suffix} blocks {r.blocks}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def summary_line(name: str, s: Score) -> str:
    def ratio(low: float, mid: float, high: float) -> str:
        return f"{mid:.2f}x ({low:.2f}-{high:.2f})"

    return (
        f"- {name}: faster path chosen in {s.right}/{s.points} ({s.right_pct:.1f}%), "
        f"{ms(s.lost_s)} ms lost of {ms(s.oracle_s)} ms oracle ({s.lost_pct:.2f}%): goal "
        f"{'met' if s.met else 'NOT met'}; predicted/actual move {ratio(*s.move_ratio)}, "
        f"recompute {ratio(*s.recompute_ratio)}"
    )
