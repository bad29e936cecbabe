"""Two pools behind one gateway, on CPU: a kvstore with ``--data-parallel-size 2`` (two pools in
/dev/shm), one worker per pool, real Redis and HTTP.

Prompts A and B (200 tokens: 12 full blocks reusable) are first served through a second gateway
that routes round robin, so A lands on pool 0 and B on pool 1. Through the stack's gateway
(``--routing prefix``) each comes back to the pool that holds it: the response reports the 192
cached tokens and the pool that served it (``X-PagedServe-Pool``), the pool's own hit counter
grows by as much and nothing is copied. Then B goes
round robin to pool 0, which does not hold it: the daemon copies B's 12 blocks from pool 1 into
pool 0 (``--peer-copy always``) and the answer is the one B's fresh prefill gave, token for token.

A second stack has small pools (39 blocks each) and CPU tiers: C served on one pool, a prompt
filling that pool pushes C's blocks out of its GPU into its CPU tier (at least 10 of its 12: the
filler's admission takes 37 blocks of the 27 free); C sent to the other pool gets all 12 copied,
those out of the GPU from the CPU tier, none recomputed, and answers as C's fresh prefill did.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from kvstore import protocol as p
from kvstore.client import KVClient
from tests.gateway.test_admin_page import (
    By,
    Select,
    WebDriver,
    browser,  # noqa: F401 (the fixture)
    gpu_map,
    log_in,
    open_page,
    requested_urls,
    wait_for,
)
from tests.stack import ADMIN_TOKEN, Stack, complete_greedy, running_stack

PROMPT_TOKENS = 200
CACHED = (PROMPT_TOKENS - 1) // 16 * 16  # the last token is always computed


@pytest.fixture(scope="module")
def two_pools(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("two-pools")
    with running_stack(
        redis_url, logs, 6, "0.01GiB", kvstore_flags=["--peer-copy", "always"], pools=2
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def small_pools(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two pools of 39 blocks (8 KiB each), CPU tiers of 1,310 blocks."""
    logs = tmp_path_factory.mktemp("small-pools")
    flags = ["--peer-copy", "always", "--swap-memory", "0.01"]
    with running_stack(redis_url, logs, 7, "0.0003GiB", kvstore_flags=flags, pools=2) as stack:
        yield stack


def tokens(answer: dict[str, Any]) -> list[str]:
    return list(answer["choices"][0]["logprobs"]["tokens"])


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def pools(stack: Stack) -> list[p.PoolRow]:
    with KVClient(stack.endpoint) as client:
        return client.call(p.GetStats()).pools


def test_requests_land_on_the_pool_holding_their_prefix_and_a_copy_answers_alike(
    two_pools: Stack,
) -> None:
    stack = two_pools
    rng = random.Random(33)
    a, b = ([rng.randrange(256) for _ in range(PROMPT_TOKENS)] for _ in range(2))
    with stack.gateway("--routing", "round_robin") as round_robin:
        fresh_a = complete_greedy(round_robin.url, a)  # pool 0
        fresh_b = complete_greedy(round_robin.url, b)  # pool 1
        assert cached(fresh_a) == cached(fresh_b) == 0
        assert (fresh_a["pool"], fresh_b["pool"]) == ("0", "1")
        first = pools(stack)
        assert [row.prefix_queried_tokens for row in first] == [PROMPT_TOKENS] * 2
        assert [len(row.workers) for row in first] == [1, 1]

        again_a = complete_greedy(stack.url, a)  # by prefix
        again_b = complete_greedy(stack.url, b)
        assert cached(again_a) == cached(again_b) == CACHED
        assert (again_a["pool"], again_b["pool"]) == ("0", "1")
        assert tokens(again_a) == tokens(fresh_a) and tokens(again_b) == tokens(fresh_b)
        second = pools(stack)
        assert [row.prefix_hit_tokens for row in second] == [CACHED, CACHED]
        assert [row.copied_in_blocks for row in second] == [0, 0]

        copied_b = complete_greedy(round_robin.url, b)  # round robin: pool 0, which lacks B
    assert cached(copied_b) == CACHED
    assert copied_b["pool"] == "0"
    assert tokens(copied_b) == tokens(fresh_b)
    third = pools(stack)
    assert [row.copied_in_blocks for row in third] == [CACHED // 16, 0]
    assert [row.prefix_hit_tokens for row in third] == [2 * CACHED, CACHED]
    assert [row.running for row in third] == [0, 0]


def test_the_admin_page_shows_each_pools_block_map(
    browser: WebDriver,  # noqa: F811 (the fixture imported above)
    two_pools: Stack,
) -> None:
    """With two pools the page offers a pool select; pool 1 chosen, it draws pool 1's map
    (``/admin/blocks?pool=1``), its cached blocks counted as the kvstore counts them."""
    stack = two_pools
    rng = random.Random(34)
    prompt = [rng.randrange(256) for _ in range(PROMPT_TOKENS)]
    with stack.gateway("--routing", "round_robin") as round_robin:
        served = [complete_greedy(round_robin.url, prompt)["pool"] for _ in range(2)]
    assert sorted(served) == ["0", "1"]  # both pools hold the prompt (one copied it, or not)
    with KVClient(stack.endpoint) as client:
        cached = [client.call(p.GetBlockMap(i)).gpu.count(2) for i in (0, 1)]  # 2: "cached"
    assert p.BLOCK_STATES[2] == "cached" and min(cached) > 0
    open_page(browser, stack)
    log_in(browser, ADMIN_TOKEN)
    choice = browser.find_element(By.ID, "pool-choice")
    wait_for("the pool select", choice.is_displayed, 30)
    options = browser.find_elements(By.CSS_SELECTOR, "#pool-select option")
    assert [o.get_attribute("value") for o in options] == ["0", "1"]
    assert "pool 1 · cpu" in options[1].text and "worker(s)" in options[1].text, options[1].text
    assert "from other pools' CPU tiers" in options[1].text, options[1].text
    wait_for("pool 0's map", lambda: gpu_map(browser).get("cached") == cached[0])
    requested_urls(browser)  # from here on
    Select(browser.find_element(By.ID, "pool-select")).select_by_value("1")
    wait_for(
        "pool 1's map requested",
        lambda: any(u.endswith("/admin/blocks?pool=1") for u in requested_urls(browser)),
    )
    wait_for("pool 1's map drawn", lambda: gpu_map(browser).get("cached") == cached[1])


def test_a_prefix_in_one_pools_cpu_tier_is_loaded_into_the_other_and_answers_alike(
    small_pools: Stack,
) -> None:
    stack = small_pools
    rng = random.Random(35)
    c = [rng.randrange(256) for _ in range(PROMPT_TOKENS)]
    total = pools(stack)[0].gpu.total
    assert total == 39
    with stack.gateway("--routing", "round_robin") as round_robin:  # pools in turn
        fresh = complete_greedy(round_robin.url, c)
        home = int(fresh["pool"])
        for _ in range(2):  # the next turn of C's pool: a prompt needing all but 2 blocks
            filler = [rng.randrange(256) for _ in range((total - 3) * 16)]
            if int(complete_greedy(round_robin.url, filler)["pool"]) == home:
                break
        else:
            raise AssertionError("round robin never came back to C's pool")
        before = pools(stack)
        loaded = complete_greedy(round_robin.url, c)  # the other pool's turn
    other = 1 - home
    assert int(loaded["pool"]) == other
    assert cached(loaded) == CACHED
    assert tokens(loaded) == tokens(fresh)
    after = pools(stack)
    copied = after[other].copied_in_blocks - before[other].copied_in_blocks
    from_cpu = after[other].loaded_in_blocks - before[other].loaded_in_blocks
    assert copied == CACHED // 16 and 10 <= from_cpu <= copied, (copied, from_cpu)
