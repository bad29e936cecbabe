"""The swap-vs-recompute cost model, proven: both paths executed over a grid, its choices scored.

A prefix hit reaches ``n`` blocks that only the CPU tier holds, after ``context`` tokens cached
on the GPU, and the request has ``suffix`` tokens of its own to prefill after them either way
(at least 1: a request computes its last token's logits even when the rest is cached).
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

The model is asked as the kvstore asks it: a ``kvstore.pricing.Pricing`` holding the
calibration of ``DevicePools.calibrate()`` (the daemon's, at startup) and the profiles of
``measure_prefill`` and ``measure_recompute`` (a worker's, at registration, CUDA graphs as the
worker's), asked ``prefix_load(n, n*16, context, suffix, running=decodes)`` and ``preempt`` (swap
out + in vs recompute of ``n*16`` tokens from 0). Scored: how often the faster path was chosen,
and the time lost (the chosen's actual minus the faster's) over the oracle's total.
``--recalibrate`` also scores ``kvstore.cost_model.CostRefit`` twice, never on a point's own
timing: refitted to the actuals of the other folds of the grid (both
paths' actuals, which a kvstore online sees only for the path it chose), and seeded by recompute
timings at ``--seed-tokens`` x ``--seed-contexts``, off the grid, both batches (a profile a
worker could measure at registration; the moves keep the calibration).

``--kinds peer`` asks the kvstore's other question (``Host._bring``): a prefix another GPU's pool
caches, copied into this pool (``PeerCopier.copy`` from a pool on cuda:1, priced by the
calibrated line ``PeerCopier.calibrate`` fits, as the daemon's start-up) or recomputed, asked
``peer_copy(copy_s, n*16, context, suffix, running=decodes)``; the same recompute timing.

    python bench/cost_sweep.py [--shape 1b|8b] [--recalibrate] [--json sweep.json]
    python bench/cost_sweep.py --kinds peer --shape 8b   # two GPUs
    python bench/cost_sweep.py --device cpu --blocks 1,4 --contexts 0,32 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from itertools import product
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


import compute.model.attention  # noqa: E402,F401  (registers the "paged" attention function)
from bench.cost_report import Row, ms, report, where  # noqa: E402
from bench.cost_rig import BLOCK, Rig, build_model, note  # noqa: E402
from compute.batch.scheduler import SchedulerConfig  # noqa: E402
from compute.model.profile import measure_prefill, measure_recompute  # noqa: E402
from kvstore.cost_model import CostRefit  # noqa: E402
from kvstore.pricing import Pricing  # noqa: E402

WORKER = "sweep"
Seeds = dict[bool, list[tuple[int, int, float]]]  # busy -> (tokens, context, seconds)


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


def sweep(args: argparse.Namespace) -> tuple[list[Row], Seeds, list[str]]:
    """Runs the grid; returns its rows, the --recalibrate profile points, the header lines."""
    note(f"building the {args.shape if args.device == 'cuda' else 'tiny'} model")
    model = build_model(args)
    note("measuring the worker's profiles (measure_prefill, measure_recompute: at registration)")
    profile = measure_prefill(model, block_size=BLOCK)
    graphs = args.device == "cuda" and not args.eager
    pieces = min(args.graph_tokens, args.budget) if graphs else 0
    recompute = measure_recompute(model, BLOCK, graph_tokens=pieces)
    note("allocating and calibrating the pools (DevicePools.calibrate, as the daemon)")
    rig = Rig(model, args)
    pricing = Pricing()
    pricing.calibration = rig.calibration
    pricing.register(WORKER, profile, recompute.points, recompute.graph_buckets)
    header = header_lines(args, profile, recompute.points, rig)
    rows: list[Row] = []
    seeds: Seeds = {}
    grid = len(args.suffixes) * len(args.contexts)
    per_point = ("prefix" in args.kinds) + ("peer" in args.kinds)
    total = len(args.batches) * len(args.blocks) * (grid * per_point + ("preempt" in args.kinds))
    try:
        for batch in args.batches:
            present = batch == "present"
            for suffix, context, n in product(args.suffixes, args.contexts, args.blocks):
                running = args.decodes if present else 0
                rec = rig.recompute_s(n * BLOCK, context, present, suffix)
                if "prefix" in args.kinds:
                    choice = pricing.prefix_load(WORKER, n, n * BLOCK, context, suffix, running)
                    move = rig.move_s(rig.pairs(context, n), to_cpu=False, present=present)
                    rows.append(Row.of("prefix", batch, context, n, suffix, choice, move, rec))
                    progress(rows[-1], len(rows), total)
                if rig.copy_line is not None:  # the kvstore's question at a peer hit
                    copy_s = rig.copy_line.seconds(n)
                    choice = pricing.peer_copy(WORKER, copy_s, n * BLOCK, context, suffix, running)
                    move = rig.peer_s(context, n, present)
                    rows.append(Row.of("peer", batch, context, n, suffix, choice, move, rec))
                    progress(rows[-1], len(rows), total)
            for n in args.blocks if "preempt" in args.kinds else []:
                choice = pricing.preempt(WORKER, n, n * BLOCK, rig.pools.cpu_pool.shape[0])
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
        if rig.peer is not None:
            rig.peer.close()
    return rows, seeds, header


def progress(r: Row, done: int, total: int) -> None:
    note(f"[{done}/{total}] {r.kind} {where(r)}: move "
         f"{ms(r.move_s)} ms, recompute {ms(r.recompute_s)} ms, chose {r.chosen}")  # fmt: skip


def header_lines(
    args: argparse.Namespace,
    profile: list[tuple[int, float]],
    recompute: list[tuple[int, int, float]],
    rig: Rig,
) -> list[str]:
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
    graphs = f"decode graphs, mixed-step graphs to {args.graph_tokens} tokens"
    graphs = graphs if cuda and not args.eager else "eager"
    cal, us = rig.calibration, 1e6
    lines = [
        f"# cost sweep {time.strftime('%Y-%m-%d %H:%M')}: {gpu}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, commit {commit}",
        f"# shape {args.shape if cuda else 'tiny'}, block {BLOCK}, repeats {args.repeats}, "
        f"budget {args.budget}, {graphs}",
        "# prefill profile: " + ", ".join(f"{t}: {ms(sec)} ms" for t, sec in profile),
        "# recompute profile (tokens@context): "
        + ", ".join(f"{t}@{c}: {ms(sec)} ms" for t, c, sec in recompute),
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
        (
            "--suffixes",
            ints,
            [1, 512],
            "the request's own tokens prefilled after the range (1: its last token only; 0: "
            "nothing, which a request never has)",
        ),
        ("--budget", int, SchedulerConfig().max_num_batched_tokens, "tokens per step at most"),
        ("--graph-tokens", int, 2048, "CUDA graphs of mixed steps up to this many tokens"),
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
    p.add_argument(
        "--kinds",
        type=words,
        default=["prefix", "preempt"],
        help="prefix: a CPU-tier load vs recompute; preempt: swap out + in vs recompute; peer: "
        "a copy from another GPU's pool (cuda:1; on CPU a second /dev/shm pool) vs recompute",
    )
    p.add_argument("--recalibrate", action="store_true", help=RECALIBRATE_HELP)
    args = p.parse_args(argv)
    if any(c % BLOCK for c in args.contexts):
        p.error(f"contexts must be multiples of {BLOCK} (a prefix hit ends on a block)")
    if not set(args.batches) <= {"absent", "present"}:
        p.error("--batches takes absent and/or present")
    if not set(args.kinds) <= {"prefix", "preempt", "peer"}:
        p.error("--kinds takes prefix, preempt and/or peer")
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
