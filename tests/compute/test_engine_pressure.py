"""Greedy output under memory pressure in random configurations, through the real kvstore
daemon, Redis and the engine: 3-7 requests of random prompt lengths and ``max_tokens`` (so
they finish at different steps and others are admitted meanwhile) in a pool of 12-30 blocks,
with or without a CPU tier for swaps. Every request must get transformers' ``generate``
tokens. The configurations below were chosen from 60 such ones (all of which matched
``generate``, also with ``Scheduler.to_place``'s guard against re-placing a victim that
launched steps still compute taken out) as those that preempt most: in each, victims came up
for placement 2-6 times while launched steps still computed them."""

from __future__ import annotations

import random

import pytest

from contracts.records import SamplingParams
from tests.compute.driver import generate_greedy
from tests.compute.serving import BLOCK_BYTES, prompts_of, run_engine

SEEDS = [0, 10, 13, 17, 33, 47]  # preemptions here (swaps, recomputes): 0+3 3+0 1+1 2+1 6+0 1+4


def configuration(seed: int) -> tuple[dict[str, list[int]], dict[str, int], list[str]]:
    """(prompts, max_tokens per request, kvstore flags) of configuration ``seed``."""
    rng = random.Random(seed)
    count = rng.randint(3, 7)
    prompts = prompts_of([rng.randint(10, 60) for _ in range(count)], seed=seed)
    max_tokens = {rid: rng.randint(4, 40) for rid in prompts}
    gib = rng.randint(12, 30) * BLOCK_BYTES / (1 << 30)
    flags = ["--kv-memory", f"{gib:.9f}GiB", "--admission-watermark", "0"]
    if rng.random() < 0.5:
        flags += ["--swap-memory", f"{rng.randint(2, 12) * BLOCK_BYTES / (1 << 30):.9f}"]
    return prompts, max_tokens, flags


@pytest.mark.parametrize("seed", SEEDS)
def test_random_pressure_gives_generates_tokens(redis_url: str, tiny: tuple, seed: int) -> None:
    prompts, max_tokens, flags = configuration(seed)
    params = {rid: SamplingParams(max_tokens=n, temperature=0.0) for rid, n in max_tokens.items()}
    outputs, stats, *_ = run_engine(redis_url, flags, prompts, 40, tiny, params=params)
    assert sum(stats.preemptions.values()) > 0, stats.preemptions  # the configuration's point
    for rid, prompt in prompts.items():
        assert outputs[rid] == generate_greedy(tiny[2], prompt, max_tokens[rid]), rid
    assert stats.gpu.used == 0 and stats.cpu.used == 0
