"""The CPU prefix tier through the whole stack: a prompt evicted from a small GPU pool comes back
from the CPU tier, and the answer is the one its fresh prefill gave.

The pool holds 24 blocks of 16 tokens. Prompt A (100 tokens: 6 full blocks) is served, then four
other 100-token prompts, one after the other: they need more blocks than are free, so A's cached
blocks, the oldest, are evicted, after the daemon copied them to the CPU tier between calls
(write-back; at eviction otherwise). A again: the prefix lookup reaches
its 6 blocks in the CPU tier, the cost model loads them back (a copy of 6 blocks of 8 KiB costs
microseconds, their prefill milliseconds), and the response reports 96 cached tokens.
"""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from kvstore import protocol as p
from kvstore.client import KVClient
from tests.stack import Stack, post_completion, running_stack

BLOCK_BYTES = 8192  # the tiny model, fp32
POOL_BLOCKS = 24


@pytest.fixture(scope="module")
def small_pool_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    gib = f"{POOL_BLOCKS * BLOCK_BYTES / 2**30:.9f}GiB"
    with running_stack(redis_url, tmp_path_factory.mktemp("tier-stack"), 5, gib) as stack:
        yield stack


def complete(stack: Stack, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return post_completion(stack.url, body)


def kv_stats(stack: Stack) -> p.Stats:
    with KVClient(stack.endpoint) as client:
        return client.call(p.GetStats())


def test_an_evicted_prompt_comes_back_from_the_cpu_tier_with_the_same_answer(
    small_pool_stack: Stack,
) -> None:
    stack = small_pool_stack
    rng = random.Random(13)
    a, *others = [[rng.randrange(256) for _ in range(100)] for _ in range(5)]
    fresh = complete(stack, a)
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for prompt in others:
        complete(stack, prompt)
    before = kv_stats(stack)
    demoted = before.tier_counts["demoted"] + before.tier_counts["demoted_at_eviction"]
    assert before.cpu_prefix_cache and demoted >= 6 and before.tier_counts["dropped"] == 0
    assert before.gpu.total <= POOL_BLOCKS
    again = complete(stack, a)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert again["choices"][0]["text"] == fresh["choices"][0]["text"]
    after = kv_stats(stack)
    assert after.tier_counts["loaded"] - before.tier_counts["loaded"] == 6
    assert after.prefix_hit_tokens_cpu - before.prefix_hit_tokens_cpu == 96
    [load] = [d for d in after.decisions if d.kind == "prefix"]
    assert load.mode == "load" and load.blocks == 6 and load.tokens == 96
    assert load.actual_s is not None and load.predicted_swap_s is not None
    with urllib.request.urlopen(f"{stack.url}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    [cpu_hits] = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("pagedserve:prefix_cache_hits_by_tier_total{") and 'tier="cpu"' in line
    ]
    assert cpu_hits == after.prefix_hit_tokens_cpu
