"""The shared-prefix scenario through HTTP: 100 requests share a 2048-token prompt prefix.

The arithmetic (as ``tests/kvstore/test_manager_exact.py`` checks it at the manager level): each
prompt is the 2048 shared tokens (128 full blocks of 16) and 100 tokens of its own. The first
request finds nothing; once its prompt is computed, the 128 shared blocks are in the prefix index,
and each of the 99 others hits exactly them: block 128 starts with its own tokens, and the block
holding the last prompt token is never reused anyway. So the hit tokens grow by 99 x 2048, the
queried tokens by 100 x 2148, and every response reports ``cached_tokens`` 0 (the first) or 2048.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp

from tests.stack import Stack, run

SHARED, OWN, REQUESTS, BLOCK = 2048, 100, 100, 16


def prompts() -> list[list[int]]:
    rng = random.Random(2048)  # tokens no other test uses as a prefix
    shared = [rng.randrange(256) for _ in range(SHARED)]
    return [shared + [i] + [rng.randrange(256) for _ in range(OWN - 1)] for i in range(REQUESTS)]


async def complete(s: aiohttp.ClientSession, url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    async with s.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def test_shared_prefix_hits_exactly_what_the_arithmetic_predicts(stack: Stack) -> None:
    before = stack.admin("/admin/cache")["prefix_cache"]
    first, *others = prompts()

    async def scenario() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            # the first request finishes (its prompt computed and indexed) before the rest start
            answers = [await complete(s, stack.url, first)]
            return answers + await asyncio.gather(*(complete(s, stack.url, p) for p in others))

    answers = run(scenario())
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached == [0] + [SHARED] * (REQUESTS - 1)
    assert all(a["usage"]["prompt_tokens"] == SHARED + OWN for a in answers)
    after = stack.admin("/admin/cache")
    prefix = after["prefix_cache"]
    assert prefix["hit_tokens"] - before["hit_tokens"] == (REQUESTS - 1) * SHARED == sum(cached)
    assert prefix["queried_tokens"] - before["queried_tokens"] == REQUESTS * (SHARED + OWN)
    assert prefix["lookups"] - before["lookups"] == REQUESTS
    assert 0 < prefix["hit_rate"] <= 1
    top = [row for row in after["top_prefixes"] if row["tokens"] == SHARED]
    assert [(row["hits"], row["tier"]) for row in top] == [(REQUESTS - 1, "gpu")], after
    # every block is back: nothing in use, the prompts' blocks cached for the next request
    assert stack.wait_blocks_released()["blocks"]["cached"] >= SHARED // BLOCK
