"""The recompute side of the kvstore's cost model: how long this worker takes to prefill.

At registration a worker reports two profiles:
- ``measure_prefill``: ``(tokens, seconds)`` of eager forwards from an empty context; the kvstore
  interpolates them to price recomputing a preempted request against swapping it;
- ``measure_recompute``: ``(tokens, context, seconds)`` of forwards prefilling ``tokens`` after
  ``context`` cached tokens, run as the worker runs them (CUDA graphs of mixed steps where it uses
  them); the kvstore fits them to price recomputing a prefix against loading it from its CPU tier.
The timings run on a scratch pool of the worker's own (a worker never writes into blocks the
kvstore did not issue), one chunk at a time, after a warm-up, synchronised, median of a few runs.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from compute.runner import ModelRunner, ScheduledChunk
from contracts.model_config import kv_geometry

log = logging.getLogger("pagedserve.compute")
DEFAULT_TOKENS = (16, 128, 512, 2048)
RECOMPUTE_TOKENS = (16, 64, 256, 1024)
RECOMPUTE_CONTEXTS = (0, 2048)


@dataclass(frozen=True)
class RecomputeProfile:
    """``points``: ``(tokens, context, seconds)``; ``graph_buckets``: the token counts of the
    worker's CUDA graphs of prefill steps (empty: it runs them eagerly)."""

    points: list[tuple[int, int, float]]
    graph_buckets: list[int]


def measure_prefill(
    model: PreTrainedModel,
    block_size: int,
    token_counts: tuple[int, ...] = DEFAULT_TOKENS,
    repeats: int = 3,
) -> list[tuple[int, float]]:
    """Median seconds of one prefill forward for each prompt length in ``token_counts``."""
    pool = _scratch_pool(model, block_size, max(token_counts))
    runner = ModelRunner(model, pool, block_size)
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    profile: list[tuple[int, float]] = []
    for tokens in token_counts:
        prompt = torch.randint(0, vocab, (tokens,), generator=generator).tolist()
        chunk = [ScheduledChunk(prompt, 0, list(range(-(-tokens // block_size))))]
        profile.append((tokens, _median_forward(runner, chunk, repeats)))
        log.info("prefill profile: %d tokens in %.2f ms", tokens, profile[-1][1] * 1e3)
    return profile


def measure_recompute(
    model: PreTrainedModel,
    block_size: int,
    graph_tokens: int = 0,
    token_counts: tuple[int, ...] = RECOMPUTE_TOKENS,
    contexts: tuple[int, ...] = RECOMPUTE_CONTEXTS,
    repeats: int = 3,
) -> RecomputeProfile:
    """Median seconds of one forward prefilling ``tokens`` after ``context`` cached tokens, for
    each pair; ``graph_tokens`` > 0 (CUDA): through the CUDA graphs of mixed steps up to that
    many tokens, as the worker's runner takes them (captured for this scratch pool, then freed;
    their sizes come with the points). Pairs past ``max_position_embeddings`` are left out."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 1 << 30
    pairs = [(c, t) for c in contexts for t in token_counts if c + t <= limit]
    if not pairs:
        raise ValueError(f"no recompute point fits {limit} positions")
    longest = max(c + t for c, t in pairs)
    pool = _scratch_pool(model, block_size, longest, zeroed=True)
    graphed = min(graph_tokens, max(t for _, t in pairs))
    runner = ModelRunner(model, pool, block_size, 0, graphed)
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(1)
    table = list(range(-(-longest // block_size)))
    profile: list[tuple[int, int, float]] = []
    for context, tokens in pairs:
        prompt = torch.randint(0, vocab, (tokens,), generator=generator).tolist()
        seconds = _median_forward(runner, [ScheduledChunk(prompt, context, table)], repeats)
        profile.append((tokens, context, seconds))
        log.info("recompute profile: %d tokens after %d in %.2f ms", tokens, context, seconds * 1e3)
    buckets = list(runner.mixed.buckets) if runner.mixed is not None else []
    del runner, pool
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return RecomputeProfile(profile, buckets)


def _scratch_pool(
    model: PreTrainedModel, block_size: int, tokens: int, zeroed: bool = False
) -> torch.Tensor:
    """A pool of the kvstore's layout holding ``tokens`` tokens, never exported."""
    geometry = kv_geometry(model.config, str(model.dtype).removeprefix("torch."))
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


def _median_forward(runner: ModelRunner, chunk: list[ScheduledChunk], repeats: int) -> float:
    """Seconds of ``runner.forward(chunk)``: the median of ``repeats`` after a warm-up."""
    device = runner.device
    runner.forward(chunk)  # warm-up (allocator, kernels' compilation)
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        runner.forward(chunk)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
