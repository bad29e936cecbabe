"""The swap-vs-recompute cost model, proven: both paths executed over a grid, its choices scored.

A prefix hit reaches ``n`` blocks that only the CPU tier holds, after ``context`` tokens cached
on the GPU, and the request has ``suffix`` tokens of its own to prefill after them either way.
Each point (blocks x context x suffix x batch) runs both paths ``--repeats`` times after a
warm-up, synchronised (medians): the load is ``DevicePools.swap_in`` of ``n`` blocks
(consecutive CPU ids into scattered GPU ids, as ``calibrate`` and the allocators do); the
recompute is the marginal time of the worker's steps through ``ModelRunner.forward`` over the
same pool (CUDA graphs as a worker captures them, unless ``--eager``): the steps prefilling
``n*16 + suffix`` tokens from ``context``, minus those prefilling the suffix from ``context +
n*16`` (the load path's), minus a decode-only step per step the recompute adds.

Batch "present": ``--decodes`` running requests decode in every step (``Scheduler.schedule``:
decodes first, the prompt chunk gets what ``--budget`` leaves), so the recompute rides in mixed
steps, and the load runs on the daemon's stream while the GPU replays those decode steps (the
daemon serves while the worker steps; on CPU nothing overlaps). "absent": the request alone.

The model is asked as the kvstore asks it, ``choose_prefix_load(n, n*16, suffix, calibration,
profile)``: the suffix is the request's own (the kvstore knows the request, not the other work
of the worker's steps), the calibration is ``DevicePools.calibrate()``'s and the
profile ``measure_prefill``'s, as the daemon and a worker take them at startup. The preemption
choice (``choose``: swap out + in vs recompute of ``n*16`` tokens from 0) is swept too. Scored:
how often the faster path was chosen, and the time lost (the chosen's actual minus the faster's)
over the oracle's total. ``--recalibrate`` also scores ``kvstore.cost_model.CostRefit`` twice,
never on a point's own timing: refitted to the actuals of the other folds of the grid (both
paths' actuals, which a kvstore online sees only for the path it chose), and seeded by recompute
timings at ``--seed-tokens`` x ``--seed-contexts``, off the grid, both batches (a profile a
worker could measure at registration; the moves keep the calibration).

    python bench/cost_sweep.py [--shape 1b|8b] [--recalibrate] [--json sweep.json]
    python bench/cost_sweep.py --device cpu --blocks 1,4 --contexts 0,32 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import product
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformers import PreTrainedModel  # noqa: E402  (after the path: bench/kernels.py)

import compute.attention  # noqa: E402,F401  (registers the "paged" attention function)
from compute.profile import measure_prefill  # noqa: E402
from compute.runner import ModelRunner, ScheduledChunk  # noqa: E402
from compute.scheduler import SchedulerConfig  # noqa: E402
from contracts.model_config import kv_geometry  # noqa: E402
from kvstore.cost_model import (  # noqa: E402
    Choice,
    CostRefit,
    SwapCalibration,
    choose,
    choose_prefix_load,
)
from kvstore.device import DevicePools  # noqa: E402

BLOCK = 16
KINDS = ("prefix", "preempt")
Seeds = dict[bool, list[tuple[int, int, float]]]  # busy -> (tokens, context, seconds)


@dataclass(frozen=True)
class Row:
    """One grid point: predictions, actual medians (seconds) and the model's choice."""

    kind: str  # "prefix" (load vs recompute) | "preempt" (swap out + in vs recompute from 0)
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


def prefill_steps(tokens: int, budget: int, decodes: int) -> list[int]:
    """Chunk sizes of the steps that prefill ``tokens`` of one request beside ``decodes``
    decodes (``Scheduler.schedule``: the decodes first, the chunk gets what the budget leaves)."""
    room = budget - decodes
    if room < 1:
        raise ValueError(f"budget {budget} leaves no room beside {decodes} decodes")
    return [min(room, tokens - done) for done in range(0, tokens, room)]


def cross_validate(rows: Sequence[Row], folds: int, seed: int = 0) -> list[Row]:
    """Each row chosen again by a ``CostRefit`` fitted to the actuals of the rows of the other
    ``folds - 1`` folds (a seeded shuffle of the grid), so no row is scored by its own timing:
    the recomputes of both kinds (the same prefill), the moves of the row's own kind."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    fold_of = {index: rank % folds for rank, index in enumerate(order)}
    refit: list[Row] = []
    for i, row in enumerate(rows):
        fit = CostRefit()
        for j, r in enumerate(rows):
            if fold_of[j] != fold_of[i]:
                busy = r.batch == "present"
                if r.kind == row.kind:
                    fit.observe_move(r.blocks, busy, r.move_s)
                fit.observe_recompute(r.blocks * BLOCK, r.context, busy, r.recompute_s, r.suffix)
        refit.append(row.rechosen(fit))
    return refit


def seeded(rows: Sequence[Row], seeds: Seeds) -> list[Row]:
    """Each row chosen again with recompute prices fitted to ``seeds`` alone (profile points
    off the grid, as a worker could measure them at registration); moves keep the calibration."""
    fit = CostRefit()
    for busy, points in seeds.items():
        for tokens, context, seconds in points:
            fit.observe_recompute(tokens, context, busy, seconds)
    return [row.rechosen(fit) for row in rows]


class Rig:
    """The worker's runner over the daemon's pool, a request's block table, the present batch."""

    def __init__(self, model: PreTrainedModel, args: argparse.Namespace) -> None:
        self.args, self.device = args, torch.device(args.device)
        cuda = self.device.type == "cuda"
        geometry = kv_geometry(model.config, str(model.dtype).removeprefix("torch."))
        request = -(-longest(args) // BLOCK)
        per_decode = -(-(args.decode_context + 1) // BLOCK)
        gpu_blocks = 1 + request + args.decodes * per_decode  # block 0: table padding
        cpu_blocks = max(*args.blocks, 64)  # 64: every size calibrate() times
        self.pools = DevicePools(geometry, BLOCK, gpu_blocks, cpu_blocks, args.device)
        if cuda:
            self.pools.pool.zero_()
        self.calibration: SwapCalibration | None = self.pools.calibrate()  # as the daemon does
        graphs = not args.eager and cuda
        pieces = min(args.graph_tokens, args.budget) if graphs else 0
        note("capturing CUDA graphs" if graphs else "building the runner")
        self.runner = ModelRunner(model, self.pools.pool, BLOCK, args.decodes * graphs, pieces)
        gen = random.Random(args.seed)
        self.table = gen.sample(range(1, 1 + request), request)  # scattered, as after churn
        vocab = model.config.get_text_config().vocab_size
        self.ids = [gen.randrange(vocab) for _ in range(request * BLOCK)]
        base = 1 + request
        tables = [
            range(base + d * per_decode, base + (d + 1) * per_decode) for d in range(args.decodes)
        ]
        self.decodes = [ScheduledChunk([1], args.decode_context, list(t)) for t in tables]
        self.decode_step_s = (
            self.median(lambda: self.forward_s(self.decodes)) if self.decodes else 0
        )

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median(self, once: Callable[[], float]) -> float:
        once()  # warm-up
        return statistics.median(once() for _ in range(self.args.repeats))

    def forward_s(self, batch: list[ScheduledChunk]) -> float:
        self.sync()
        start = time.perf_counter()
        self.runner.forward(batch)
        self.sync()
        return time.perf_counter() - start

    def steps(self, start: int, tokens: int, present: bool) -> list[list[ScheduledChunk]]:
        """The worker's steps that compute ``tokens`` tokens of the request from ``start``."""
        others = self.decodes if present else []
        batches, pos = [], start
        for size in prefill_steps(tokens, self.args.budget, len(others)):
            batches.append([*others, ScheduledChunk(self.ids[:size], pos, self.table)])
            pos += size
        return batches

    def recompute_s(self, tokens: int, context: int, present: bool, suffix: int) -> float:
        """Marginal seconds of recomputing ``tokens`` after ``context`` (see the module doc)."""
        with_range = self.steps(context, tokens + suffix, present)
        without = self.steps(context + tokens, suffix, present) if suffix else []
        extra = len(with_range) - len(without) if present else 0

        def once() -> float:
            spent = sum(self.forward_s(batch) for batch in with_range)
            spent -= sum(self.forward_s(batch) for batch in without)
            return spent - sum(self.forward_s(self.decodes) for _ in range(extra))

        return max(self.median(once), 0.0)

    def move_s(self, pairs: list[tuple[int, int]], to_cpu: bool, present: bool) -> float:
        """Seconds of one swap (``(gpu, cpu)`` pairs), while the present batch keeps the GPU
        busy: decode steps enqueued for several times the swap's calibrated time."""
        cal = self.calibration
        line = (cal.swap_out if to_cpu else cal.swap_in) if cal else None
        predicted = line.seconds(len(pairs)) if line else 1e-3
        move = self.pools.swap_out if to_cpu else self.pools.swap_in
        moved = pairs if to_cpu else [(c, g) for g, c in pairs]

        def once() -> float:
            self.sync()
            if not present or self.device.type != "cuda":
                return move(moved)
            for factor in (3, 12, 48):  # more decode steps until they outlast the swap
                self.busy(factor * predicted + 1e-3)
                seconds = move(moved)
                covered = not torch.cuda.current_stream(self.device).query()
                self.sync()
                if covered:
                    break
            return seconds

        return self.median(once)

    def busy(self, seconds: float) -> None:
        """Enqueues the present batch's decode steps for about ``seconds`` of device time."""
        count = min(math.ceil(seconds / max(self.decode_step_s, 1e-5)) + 1, 2000)
        self.runner.forward(self.decodes)  # loads the decode graph's inputs (or runs eagerly)
        graphs = self.runner.graphs
        for _ in range(count - 1):
            if graphs is not None and len(self.decodes) <= graphs.max_batch:
                graphs.replay(len(self.decodes))
            else:
                self.runner.forward(self.decodes)

    def pairs(self, context: int, blocks: int) -> list[tuple[int, int]]:
        """(GPU, CPU) ids of the range after ``context``: CPU ids consecutive, as ``calibrate``."""
        first = context // BLOCK
        return list(zip(self.table[first : first + blocks], range(blocks), strict=True))


def build_model(args: argparse.Namespace) -> PreTrainedModel:
    """The worker's model: ``tiny`` on CPU (``load_model``); on CUDA a random bf16 Llama
    (``bench.serve``'s configs, initialised on the GPU: minutes faster for 8b), fused as a
    worker fuses it."""
    if args.device == "cpu":
        from compute.models import load_model

        return load_model("tiny", "auto", "cpu")[0]
    from transformers import AutoModelForCausalLM

    from bench.serve import SHAPES
    from compute.fused import fuse_layers

    config = SHAPES[args.shape]()
    config.max_position_embeddings = max(config.max_position_embeddings, longest(args) + BLOCK)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation="paged", dtype=torch.bfloat16
        )
    fuse_layers(model.eval())
    return model


def longest(args: argparse.Namespace) -> int:
    """Tokens of the swept request at most: its context, the range and its suffix."""
    grid = max(args.contexts) + max(args.blocks) * BLOCK + max(args.suffixes)
    seeds = max(args.seed_contexts) + max(args.seed_tokens) if args.recalibrate else 0
    return max(grid, seeds)


def note(text: str) -> None:
    print(f"# {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def sweep(args: argparse.Namespace) -> tuple[list[Row], Seeds, list[str]]:
    """Runs the grid; returns its rows, the --recalibrate profile points, the header lines."""
    note(f"building the {args.shape if args.device == 'cuda' else 'tiny'} model")
    model = build_model(args)
    note("measuring the prefill profile (measure_prefill, as a worker at registration)")
    profile = measure_prefill(model, block_size=BLOCK)
    note("allocating and calibrating the pools (DevicePools.calibrate, as the daemon)")
    rig = Rig(model, args)
    cal = rig.calibration
    header = header_lines(args, profile, rig)
    rows: list[Row] = []
    seeds: Seeds = {}
    prefix_points = len(args.suffixes) * len(args.contexts)
    total = len(args.batches) * len(args.blocks) * (prefix_points + (not args.no_preempt))
    try:
        for batch in args.batches:
            present = batch == "present"
            for suffix, context, n in product(args.suffixes, args.contexts, args.blocks):
                choice = choose_prefix_load(n, n * BLOCK, suffix, cal, profile)
                move = rig.move_s(rig.pairs(context, n), to_cpu=False, present=present)
                rec = rig.recompute_s(n * BLOCK, context, present, suffix)
                rows.append(Row.of("prefix", batch, context, n, suffix, choice, move, rec))
                progress(rows[-1], len(rows), total)
            for n in [] if args.no_preempt else args.blocks:
                choice = choose(n, n * BLOCK, cal, profile, rig.pools.cpu_pool.shape[0])
                pairs = rig.pairs(0, n)
                move = rig.move_s(pairs, True, present) + rig.move_s(pairs, False, present)
                rec = rig.recompute_s(n * BLOCK, 0, present, 0)  # a victim has no suffix
                rows.append(Row.of("preempt", batch, 0, n, 0, choice, move, rec))
                progress(rows[-1], len(rows), total)
            if args.recalibrate:  # off the grid: tokens and contexts it never has
                points = [(t, c) for t in args.seed_tokens for c in args.seed_contexts]
                seeds[present] = [(t, c, rig.recompute_s(t, c, present, 0)) for t, c in points]
    finally:
        rig.pools.close()
    return rows, seeds, header


def progress(r: Row, done: int, total: int) -> None:
    note(f"[{done}/{total}] {r.kind} {where(r)}: move "
         f"{ms(r.move_s)} ms, recompute {ms(r.recompute_s)} ms, chose {r.chosen}")  # fmt: skip


def header_lines(args: argparse.Namespace, profile: list[tuple[int, float]], rig: Rig) -> list[str]:
    def git(*cmd: str) -> str:
        try:
            run = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True)
            return run.stdout.strip() if run.returncode == 0 else ""
        except OSError:
            return ""

    import transformers

    dirty = " (dirty)" if git("status", "--porcelain", "--untracked-files=no") else ""
    commit = (git("rev-parse", "--short", "HEAD") or "unknown") + dirty
    cuda = args.device == "cuda"
    gpu = torch.cuda.get_device_name() if cuda else "CPU (tiny model)"
    graphs = f"decode graphs, piecewise graphs to {args.graph_tokens} tokens"
    graphs = graphs if cuda and not args.eager else "eager"
    cal, us = rig.calibration, 1e6
    lines = [
        f"# cost sweep {time.strftime('%Y-%m-%d %H:%M')}: {gpu}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, commit {commit}",
        f"# shape {args.shape if cuda else 'tiny'}, block {BLOCK}, repeats {args.repeats}, "
        f"budget {args.budget}, {graphs}",
        "# prefill profile: " + ", ".join(f"{t}: {ms(sec)} ms" for t, sec in profile),
        f"# present batch: {args.decodes} decodes at context {args.decode_context}, "
        f"{ms(rig.decode_step_s)} ms a decode step",
    ]
    if cal is not None:
        lines.append(
            f"# calibration ({cal.block_bytes >> 10} KiB blocks): swap-in "
            f"{cal.swap_in.fixed_s * us:.0f} µs + {cal.swap_in.per_unit_s * us:.2f} µs/block, "
            f"swap-out {cal.swap_out.fixed_s * us:.0f} µs + "
            f"{cal.swap_out.per_unit_s * us:.2f} µs/block"
        )
    return lines


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


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def words(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


DEVICE_HELP = "cpu: the tiny model, a /dev/shm pool, nothing overlaps (a smoke run)"
RECALIBRATE_HELP = (
    "also score CostRefit: fitted to the other folds' actuals, and seeded by a profile measured "
    "at --seed-tokens x --seed-contexts (both batches)"
)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    p.add_argument("--shape", choices=("1b", "8b"), default="1b", help="Llama-3.2-1B or -3.1-8B")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=DEVICE_HELP)
    options: list[tuple[str, Callable[[str], object], object, str]] = [
        (
            "--blocks",
            ints,
            [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
            "blocks the CPU tier holds (comma-separated)",
        ),
        ("--contexts", ints, [0, 512, 2048, 8192], "tokens cached before them (multiples of 16)"),
        (
            "--batches",
            words,
            ["absent", "present"],
            "absent: alone; present: beside --decodes (either or both)",
        ),
        ("--decodes", int, 64, "running requests decoding in every present step"),
        ("--decode-context", int, 1024, "their context length"),
        ("--suffixes", ints, [0, 512], "the request's own tokens prefilled after the range"),
        ("--budget", int, SchedulerConfig().max_num_batched_tokens, "tokens per step at most"),
        ("--graph-tokens", int, 2048, "piecewise CUDA graphs up to this many tokens, as a worker"),
        ("--repeats", int, 5, "timed runs of each path (median), after a warm-up"),
        ("--folds", int, 2, "folds of --recalibrate's refit on the grid"),
        (
            "--seed-tokens",
            ints,
            [40, 360, 1400, 6000],
            "--recalibrate's profile: tokens (comma-separated)",
        ),
        ("--seed-contexts", ints, [1024, 4096], "--recalibrate's profile: contexts"),
        ("--seed", int, 0, "block tables, token ids and folds"),
        ("--json", Path, None, "also write the rows here"),
    ]
    for flag, kind, default, text in options:
        p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs: every step eager")
    p.add_argument("--no-preempt", action="store_true", help="skip the preemption rows")
    p.add_argument("--recalibrate", action="store_true", help=RECALIBRATE_HELP)
    args = p.parse_args(argv)
    if any(c % BLOCK for c in args.contexts):
        p.error(f"contexts must be multiples of {BLOCK} (a prefix hit ends on a block)")
    if not set(args.batches) <= {"absent", "present"}:
        p.error("--batches takes absent and/or present")
    if "present" not in args.batches:
        args.decodes = 0
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, list[Row]]:
    """Runs the sweep, prints the report; returns the rows by model (shipped, refit, seeded)."""
    args = parse(argv)
    started = time.perf_counter()
    rows, seeds, header = sweep(args)
    lines = [*header, "", *report(rows, "model as shipped")]
    results = {"shipped": rows}
    if args.recalibrate:
        results["refit"] = cross_validate(rows, args.folds, args.seed)
        results["seeded"] = seeded(rows, seeds)
        title = f"CostRefit on the grid's actuals, {args.folds}-fold: each point out of its fold"
        lines += ["", *report(results["refit"], title, table=False)]
        title = "CostRefit seeded by a profile at tokens x contexts off the grid (no grid timing)"
        lines += ["", *report(results["seeded"], title, table=False)]
        for busy, points in seeds.items():
            text = ", ".join(f"{t}@{c}: {ms(sec)}" for t, c, sec in points)
            lines.append(f"# seed profile ({'present' if busy else 'absent'}), ms: {text}")
    lines.append(f"# swept in {time.perf_counter() - started:.0f} s")
    print("\n".join(lines))
    if args.json:
        dump = {"header": header, **{k: [asdict(r) for r in v] for k, v in results.items()}}
        args.json.write_text(json.dumps(dump, indent=1))
    return results


if __name__ == "__main__":
    main()
