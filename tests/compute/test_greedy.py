"""Greedy decoding through the paged model path equals transformers' own ``generate``.

Tiny fp32 random models of four families; packed batches of prefills, chunked prefills and
decodes; blocks from the real ``KVCacheManager``; K/V in a CPU pool through ``ModelRunner``.
"""

from __future__ import annotations

import functools
import random

import pytest
from transformers import PreTrainedModel

from compute.model.models import FAMILIES, tiny_family_config
from tests.compute.driver import (
    GreedyDriver,
    generate_greedy,
    paged_model,
    reference_model,
    run_chunked_schedule,
)

PROMPT_LENS = (5, 17, 33, 40)
MAX_NEW = (12, 8, 16, 10)


@functools.cache
def family_setup(family: str) -> tuple[PreTrainedModel, list[list[int]], list[list[int]]]:
    """(paged model, prompts, generate's outputs) of one family, computed once per session."""
    seed = FAMILIES.index(family)
    model = paged_model(tiny_family_config(family), seed)
    rng = random.Random(100 + seed)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENS]
    ref = reference_model(model)
    expected = [generate_greedy(ref, p, m) for p, m in zip(prompts, MAX_NEW, strict=True)]
    return model, prompts, expected


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_outputs_are_not_degenerate(family: str) -> None:
    """Guards the other tests' power: outputs are long (EOS may end one early) and vary."""
    _, _, expected = family_setup(family)
    assert sum(len(e) for e in expected) >= 30
    assert len({t for e in expected for t in e}) >= 10


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_prefills_then_packed_decodes(family: str) -> None:
    model, prompts, expected = family_setup(family)
    driver = GreedyDriver(model)
    for i, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        driver.admit(f"r{i}", prompt, max_new)
    driver.run()
    # step 1 packs the four whole prompts; every later step packs one decode per live request
    assert driver.steps[0] == [(f"r{i}", 0, n) for i, n in enumerate(PROMPT_LENS)]
    assert all(n == 1 for step in driver.steps[1:] for _, _, n in step)
    assert len(driver.steps[1]) == 4
    assert [driver.seqs[f"r{i}"].output for i in range(4)] == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_mixed_with_decodes(family: str) -> None:
    """A 48-token budget per step: the 33-token prompt is prefilled in two chunks; a request
    admitted late is prefilled in two chunks while the others decode."""
    model, prompts, expected = family_setup(family)
    driver = run_chunked_schedule(model, prompts, MAX_NEW)
    assert driver.steps[0] == [("r0", 0, 5), ("r1", 0, 17), ("r2", 0, 26)]
    # decodes, the rest of r2's prompt (not block-aligned) and most of r3's prompt, packed
    assert driver.steps[1] == [("r0", 5, 1), ("r1", 17, 1), ("r2", 26, 7), ("r3", 0, 39)]
    assert driver.steps[2] == [("r0", 6, 1), ("r1", 18, 1), ("r2", 33, 1), ("r3", 39, 1)]
    assert [driver.seqs[f"r{i}"].output for i in range(4)] == expected


def test_one_token_chunks() -> None:
    """Prefill one token per step (every step a q_len-1 row per request, crossing blocks)."""
    model, prompts, expected = family_setup("qwen3")
    driver = GreedyDriver(model, block_size=8, token_budget=1)
    driver.admit("a", prompts[1], MAX_NEW[1])
    driver.run()
    assert all(n == 1 for step in driver.steps for _, _, n in step)
    assert driver.seqs["a"].output == expected[1]


def test_prefix_cache_hit_matches_cold_run() -> None:
    model, _, _ = family_setup("llama")
    rng = random.Random(7)
    prefix = [rng.randrange(256) for _ in range(32)]
    first = [*prefix, *(rng.randrange(256) for _ in range(8))]
    second = [*prefix, *(rng.randrange(256) for _ in range(5))]
    assert first[32] != second[32]

    warm = GreedyDriver(model)
    a = warm.admit("a", first, 10)
    warm.step()  # a's prefill runs and is reported (num_computed 40): blocks 0 and 1 registered
    b = warm.admit("b", second, 12)
    assert b.num_cached_tokens == 32 and b.num_computed == 32
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    warm.run()
    assert warm.steps[1][1] == ("b", 32, 5)  # only the 5 uncached tokens are computed

    cold = GreedyDriver(model)
    c = cold.admit("b", second, 12)
    assert c.num_cached_tokens == 0
    cold.run()
    assert b.output == c.output
    ref = reference_model(model)
    assert b.output == generate_greedy(ref, second, 12)
    assert a.output == generate_greedy(ref, first, 10)
