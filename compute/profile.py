"""The recompute side of the kvstore's cost model: how long this worker takes to prefill.

At registration a worker reports ``(tokens, seconds)`` for a few prompt lengths; the kvstore
interpolates them to price recomputing a preempted request against swapping it. The timing runs
on a scratch pool of the worker's own (a worker never writes into blocks the kvstore did not
issue), one prompt at a time, after a warm-up, synchronised, median of a few runs.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
from transformers import PreTrainedModel

from compute.runner import ModelRunner, ScheduledChunk
from contracts.model_config import kv_geometry

log = logging.getLogger("pagedserve.compute")
DEFAULT_TOKENS = (16, 128, 512, 2048)


def measure_prefill(
    model: PreTrainedModel,
    block_size: int,
    token_counts: tuple[int, ...] = DEFAULT_TOKENS,
    repeats: int = 3,
) -> list[tuple[int, float]]:
    """Median seconds of one prefill forward for each prompt length in ``token_counts``."""
    geometry = kv_geometry(model.config, str(model.dtype).removeprefix("torch."))
    num_blocks = -(-max(token_counts) // block_size)
    shape = [
        num_blocks,
        geometry.num_layers,
        2,
        block_size,
        geometry.num_kv_heads,
        geometry.head_dim,
    ]
    pool = torch.empty(shape, dtype=model.dtype, device=model.device)  # scratch, never exported
    runner = ModelRunner(model, pool, block_size)
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    profile: list[tuple[int, float]] = []
    for tokens in token_counts:
        prompt = torch.randint(0, vocab, (tokens,), generator=generator).tolist()
        chunk = [ScheduledChunk(prompt, 0, list(range(-(-tokens // block_size))))]
        runner.forward(chunk)  # warm-up (allocator, kernels' compilation)
        times = []
        for _ in range(repeats):
            _synchronize(model.device)
            start = time.perf_counter()
            runner.forward(chunk)
            _synchronize(model.device)
            times.append(time.perf_counter() - start)
        profile.append((tokens, statistics.median(times)))
        log.info("prefill profile: %d tokens in %.2f ms", tokens, profile[-1][1] * 1e3)
    return profile


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
