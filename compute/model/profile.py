"""The recompute side of the kvstore's cost model: how long this worker takes to prefill.

At registration a worker reports two profiles:
- ``measure_prefill``: ``(tokens, seconds)`` of eager forwards from an empty context; the kvstore
  interpolates them to price recomputing a preempted request against swapping it;
- ``measure_recompute``: ``(tokens, context, seconds)`` of forwards prefilling ``tokens`` after
  ``context`` cached tokens, run as the worker runs them (CUDA graphs of mixed steps where it uses
  them); the kvstore fits them to price recomputing a prefix against loading it from its CPU tier.
The timings run on a scratch pool of the worker's own (a worker never writes into blocks the
kvstore did not issue), one chunk at a time, after a warm-up, synchronised, median of a few runs.
In a tensor-parallel group rank 0 measures and the other ranks follow: each builds the same
scratch pool of its own (``scratch_runner``, sent as a ``scratch`` plan) and runs every forward
rank 0 times, until rank 0 ``release``s it.

``measure_profiles`` takes both within a ``Budget`` of seconds (the worker's start-up): points in
order of their work (``forward_work``: FLOPs of the linear layers and of attention), each only if
its predicted cost fits what is left; the points past it are left out (the kvstore extrapolates
from the measured ones). Where the worker's forwards all run eagerly, one grid serves both
profiles (the prefill profile is its points after no context).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from transformers import PreTrainedModel

from compute.model.mixed_graphs import MIXED_GRAPH_MODEL_TYPES, token_buckets
from compute.model.runner import ModelRunner, ScheduledChunk
from compute.parallel.layers import TPGroup
from compute.parallel.step_plan import RunnerSettings, ScratchPool, StepPlan, send_plan
from contracts.model_config import kv_geometry

log = logging.getLogger("pagedserve.compute")
DEFAULT_TOKENS = (16, 128, 512, 2048)
RECOMPUTE_TOKENS = (16, 64, 256, 1024)
RECOMPUTE_CONTEXTS = (0, 2048)
SHORT_S = 0.25  # a forward predicted shorter than this is timed 3 times (median), else once
MAX_WORST = 4.0  # the most a shortfall scales predictions by (one noisy point cannot stop all)

P = TypeVar("P")


@dataclass(frozen=True)
class RecomputeProfile:
    """``points``: ``(tokens, context, seconds)``; ``graph_buckets``: the token counts of the
    worker's CUDA graphs of prefill steps (empty: it runs them eagerly)."""

    points: list[tuple[int, int, float]]
    graph_buckets: list[int]


@dataclass(frozen=True)
class Profiles:
    """Both profiles as a worker registers them; ``skipped``: the points the budget left out of
    either; ``seconds``: how long measuring took."""

    prefill: list[tuple[int, float]]
    recompute: RecomputeProfile
    skipped: int = 0
    seconds: float = 0.0


@dataclass
class Budget:
    """``seconds`` of measuring, read on ``clock``, from the first ``start()`` on. ``worst``:
    the largest ratio of a point's measured cost to its prediction so far, at most
    ``MAX_WORST`` (predictions are scaled by it: a device whose attention is slower than its
    FLOPs say is predicted so; a point slowed by another process's burst weighs no more)."""

    seconds: float
    clock: Callable[[], float] = time.monotonic
    started: float | None = None
    worst: float = 1.0
    skipped: list[object] = field(default_factory=list)

    def start(self) -> None:
        if self.started is None:
            self.started = self.clock()

    def left(self) -> float:
        self.start()
        assert self.started is not None
        return self.seconds - (self.clock() - self.started)


def unlimited() -> Budget:
    return Budget(float("inf"))


def measure_points(
    points: Sequence[P],
    work: Callable[[P], float],
    run: Callable[[P, int, float], float],
    budget: Budget,
    repeats: int = 3,
) -> list[tuple[P, float]]:
    """Times ``points`` in order of ``work`` (cheapest first) while ``budget`` lasts.
    ``run(point, r, left)``: the median seconds of ``r`` forwards of ``point`` after one
    warm-up (``_median_forward``: the warm-up's own time when the ``left`` seconds would not
    hold another forward). A point's predicted forward is the last measured one's seconds
    scaled by their work ratio and by ``budget.worst``; it runs only if its warm-up and timed
    forwards (3, or 1 for a forward predicted past ``SHORT_S``; ``repeats`` for every point of
    an unlimited budget) fit what is left, and once one does not, it and every point after it
    are left out (added to ``budget.skipped``). A budget of 0 measures nothing; any other
    measures the cheapest point. Returns ``(point, seconds)`` in measuring order."""
    order = sorted(points, key=work)
    measured: list[tuple[P, float]] = []
    for i, point in enumerate(order):
        limited = budget.seconds != float("inf")
        scaled = predicted = None
        if measured:
            last, seconds = measured[-1]
            scaled = seconds * work(point) / max(work(last), 1e-30)
            predicted = scaled * budget.worst
        times = (
            repeats if not limited else (3 if predicted is not None and predicted < SHORT_S else 1)
        )
        left = budget.left()
        if left <= 0 or (predicted is not None and (1 + times) * predicted > left):
            budget.skipped.extend(order[i:])
            break
        seconds = run(point, times, left)
        if scaled is not None and scaled > 0:
            budget.worst = min(max(budget.worst, seconds / scaled), MAX_WORST)
        measured.append((point, seconds))
    return measured


def forward_work(model: PreTrainedModel) -> Callable[[tuple[int, int]], float]:
    """FLOPs of a forward prefilling ``tokens`` after ``context``: ``2 * params`` per token in
    the linear layers, ``4 * layers * heads * head_dim`` per (query, key) pair in attention."""
    config = model.config.get_text_config()
    geometry = kv_geometry(model.config, str(model.dtype).removeprefix("torch."))
    embeddings = sum(p.numel() for p in model.get_input_embeddings().parameters())
    linear = 2.0 * max(sum(p.numel() for p in model.parameters()) - embeddings, 1)
    pair = 4.0 * geometry.num_layers * int(config.num_attention_heads) * geometry.head_dim

    def work(point: tuple[int, int]) -> float:
        tokens, context = point
        return tokens * linear + (tokens * context + tokens * tokens / 2) * pair

    return work


def graphs_used(model: PreTrainedModel, graph_tokens: int) -> bool:
    """Whether the worker runs prefill steps through CUDA graphs (``ModelRunner``'s rule)."""
    return (
        graph_tokens > 0
        and model.device.type == "cuda"
        and model.config.model_type in MIXED_GRAPH_MODEL_TYPES
    )


def measure_profiles(
    model: PreTrainedModel,
    block_size: int,
    graph_tokens: int,
    budget: Budget,
    group: TPGroup | None = None,
) -> Profiles:
    """Both profiles within ``budget`` (``group``: of rank 0 of a tensor-parallel group, whose
    other ranks follow). Eager forwards (no graphs): one grid, ``DEFAULT_TOKENS`` and
    ``RECOMPUTE_TOKENS`` after no context, ``RECOMPUTE_TOKENS`` after the other
    ``RECOMPUTE_CONTEXTS``; the prefill profile is its points after no context."""
    budget.start()
    skipped_before = len(budget.skipped)
    if graphs_used(model, graph_tokens):
        prefill = measure_prefill(model, block_size, budget=budget, group=group)
        recompute = measure_recompute(model, block_size, graph_tokens, budget=budget, group=group)
    else:
        tokens = tuple(sorted({*DEFAULT_TOKENS, *RECOMPUTE_TOKENS}))
        recompute = measure_recompute(
            model,
            block_size,
            0,
            tokens,
            RECOMPUTE_CONTEXTS,
            budget=budget,
            only=RECOMPUTE_TOKENS,
            group=group,
        )
        prefill = sorted((t, s) for t, c, s in recompute.points if c == 0)
    assert budget.started is not None
    spent = budget.clock() - budget.started
    return Profiles(prefill, recompute, len(budget.skipped) - skipped_before, spent)


def measure_prefill(
    model: PreTrainedModel,
    block_size: int,
    token_counts: tuple[int, ...] = DEFAULT_TOKENS,
    repeats: int = 3,
    budget: Budget | None = None,
    group: TPGroup | None = None,
) -> list[tuple[int, float]]:
    """Median seconds of one prefill forward for each prompt length in ``token_counts`` (within
    ``budget``: the ones it leaves out are missing), by prompt length."""
    budget = budget or unlimited()
    if budget.left() <= 0:
        budget.skipped.extend(token_counts)
        return []
    settings = RunnerSettings(block_size, 0, 0, 256)
    runner = lead_scratch(model, ScratchPool(max(token_counts), False, settings), group)
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = {t: torch.randint(0, vocab, (t,), generator=generator).tolist() for t in token_counts}
    work = forward_work(model)

    def run(tokens: int, times: int, left: float) -> float:
        chunk = [ScheduledChunk(prompts[tokens], 0, list(range(-(-tokens // block_size))))]
        seconds = _median_forward(runner, chunk, times, left)
        log.info("prefill profile: %d tokens in %.2f ms", tokens, seconds * 1e3)
        return seconds

    try:
        timed = measure_points(token_counts, lambda t: work((t, 0)), run, budget, repeats)
    finally:
        runner.stop_followers("release")
    return sorted(timed)


def measure_recompute(
    model: PreTrainedModel,
    block_size: int,
    graph_tokens: int = 0,
    token_counts: tuple[int, ...] = RECOMPUTE_TOKENS,
    contexts: tuple[int, ...] = RECOMPUTE_CONTEXTS,
    repeats: int = 3,
    budget: Budget | None = None,
    only: tuple[int, ...] | None = None,
    group: TPGroup | None = None,
) -> RecomputeProfile:
    """Median seconds of one forward prefilling ``tokens`` after ``context`` cached tokens, for
    each pair (``only``: the token counts timed after a context other than 0; default all);
    ``graph_tokens`` > 0 (CUDA): through CUDA graphs of mixed steps, as the worker's runner of
    that many tokens takes them (those of the points' sizes, captured for this scratch pool,
    then freed; the sizes the worker's runner captures come with the points). Pairs past
    ``max_position_embeddings`` are left out; so are those ``budget`` leaves out (added to
    its ``skipped``). Points by context, then tokens."""
    budget = budget or unlimited()
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 1 << 30
    later = token_counts if only is None else only
    pairs = [
        (t, c) for c in contexts for t in (token_counts if c == 0 else later) if c + t <= limit
    ]
    if not pairs:
        raise ValueError(f"no recompute point fits {limit} positions")
    graphed = graphs_used(model, graph_tokens)
    buckets = token_buckets(graph_tokens) if graphed else []
    if budget.left() <= 0:
        budget.skipped.extend(pairs)
        return RecomputeProfile([], buckets)
    needed = sorted({next((b for b in buckets if b >= t), t) for t, _ in pairs} & set(buckets))
    timed = _time_recompute(model, block_size, pairs, needed, budget, repeats, group)
    if model.device.type == "cuda":
        torch.cuda.empty_cache()  # the scratch pool and graphs are gone
    points = sorted((t, c, s) for (t, c), s in timed)
    points.sort(key=lambda p: p[1])
    return RecomputeProfile(points, buckets)


def _time_recompute(
    model: PreTrainedModel,
    block_size: int,
    pairs: list[tuple[int, int]],
    buckets: list[int],
    budget: Budget,
    repeats: int,
    group: TPGroup | None,
) -> list[tuple[tuple[int, int], float]]:
    """``measure_points`` over ``pairs`` on a scratch pool and runner (CUDA graphs of the
    token counts ``buckets``), both freed on return."""
    longest = max(c + t for t, c in pairs)
    settings = RunnerSettings(block_size, 0, max(buckets, default=0), 256, buckets)
    runner = lead_scratch(model, ScratchPool(longest, True, settings), group)
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(1)
    prompts = {t: torch.randint(0, vocab, (t,), generator=generator).tolist() for t, _ in pairs}
    table = list(range(-(-longest // block_size)))

    def run(pair: tuple[int, int], times: int, left: float) -> float:
        tokens, context = pair
        chunk = [ScheduledChunk(prompts[tokens], context, table)]
        seconds = _median_forward(runner, chunk, times, left)
        log.info("recompute profile: %d tokens after %d in %.2f ms", tokens, context, seconds * 1e3)
        return seconds

    try:
        return measure_points(pairs, forward_work(model), run, budget, repeats)
    finally:
        runner.stop_followers("release")


def lead_scratch(model: PreTrainedModel, spec: ScratchPool, group: TPGroup | None) -> ModelRunner:
    """``scratch_runner``; on rank 0 of a group, once the other ranks are told to build theirs
    (they follow it until its ``stop_followers("release")``)."""
    if group is not None and group.size > 1 and group.rank == 0:
        send_plan(StepPlan("scratch", scratch=spec), group)
    return scratch_runner(model, spec, group)


def scratch_runner(model: PreTrainedModel, spec: ScratchPool, group: TPGroup | None) -> ModelRunner:
    """A runner over a scratch pool of ``spec`` (this rank's KV heads in a group)."""
    s = spec.settings
    return ModelRunner(
        model,
        _scratch_pool(model, s.block_size, spec.tokens, spec.zeroed, group),
        s.block_size,
        cuda_graph_max_batch=s.cuda_graph_max_batch,
        cuda_graph_max_tokens=s.cuda_graph_max_tokens,
        max_chunks=s.max_chunks,
        cuda_graph_token_buckets=s.token_buckets,
        group=group,
    )


def _scratch_pool(
    model: PreTrainedModel,
    block_size: int,
    tokens: int,
    zeroed: bool = False,
    group: TPGroup | None = None,
) -> torch.Tensor:
    """A pool of the kvstore's layout holding ``tokens`` tokens, never exported."""
    ranks = group.size if group is not None else 1
    geometry = kv_geometry(model.config, str(model.dtype).removeprefix("torch."), ranks)
    shape = [
        -(-tokens // block_size),
        geometry.num_layers,
        2,
        block_size,
        geometry.num_kv_heads,
        geometry.head_dim,
    ]
    make = torch.zeros if zeroed else torch.empty
    return make(shape, dtype=model.dtype, device=model.device)


def _median_forward(
    runner: ModelRunner, chunk: list[ScheduledChunk], repeats: int, left_s: float = math.inf
) -> float:
    """Seconds of ``runner.forward(chunk)``: the median of ``repeats`` after a warm-up; the
    warm-up's own time (an overestimate: it includes first-use costs) when the ``left_s``
    seconds would not hold another forward as long."""
    device = runner.device
    _synchronize(device)
    start = time.perf_counter()
    runner.forward(chunk)  # warm-up (allocator, kernels' compilation)
    _synchronize(device)
    warm_up = time.perf_counter() - start
    if 2 * warm_up > left_s:
        return warm_up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward(chunk)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
