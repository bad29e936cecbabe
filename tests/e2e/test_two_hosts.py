"""Two hosts on one machine, routed by prefix: two kvstores (each its own pool in /dev/shm and
its own worker), one Redis shared (as hosts share it), one gateway that knows both (``--nodes
h2=...``); the second host's worker reads its own streams (``--node h2``).

Prompts X and Y are first dealt to the hosts in turn (``--routing round_robin``), so X is
computed on the first host and Y on the second. A gateway routing by prefix then sends each back
to the host holding it: the response says which (``X-PagedServe-Pool``), reports the cached
tokens and gives the fresh run's tokens; each host's own hit counter shows it, and the quotes
every host gave for each request left nothing counted as queued. A host whose kvstore is gone
is left out: its requests go to the other host.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from contracts import queue_keys
from gateway.config import GatewayConfig
from kvstore import protocol as p
from kvstore.client import KVClient
from tests.stack import Stack, complete_greedy, running_stack

PROMPT_TOKENS = 200
CACHED = (PROMPT_TOKENS - 1) // 16 * 16  # the last token is always computed
DB = 7  # both hosts' Redis database: the one shared service


@pytest.fixture(scope="module")
def two_hosts(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Stack]]:
    first_logs, second_logs = (tmp_path_factory.mktemp(f"host-{n}") for n in ("a", "b"))
    with (
        running_stack(redis_url, first_logs, DB, "0.01GiB") as first,
        running_stack(
            redis_url, second_logs, DB, "0.01GiB", "--node", "h2", compute_flags=["--node", "h2"]
        ) as second,
    ):
        yield [first, second]


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def tokens(answer: dict[str, Any]) -> list[str]:
    return list(answer["choices"][0]["logprobs"]["tokens"])


def pool_rows(stack: Stack) -> p.PoolRow:
    with KVClient(stack.endpoint) as client:
        (row,) = client.call(p.GetStats()).pools
        return row


def test_requests_go_to_the_host_holding_their_prefix(two_hosts: list[Stack]) -> None:
    first, second = two_hosts
    nodes = f"h2={second.endpoint}"
    rng = random.Random(36)
    x, y = ([rng.randrange(256) for _ in range(PROMPT_TOKENS)] for _ in range(2))
    with first.gateway("--nodes", nodes, "--routing", "round_robin") as in_turn:
        fresh_x = complete_greedy(in_turn.url, x)
        fresh_y = complete_greedy(in_turn.url, y)
    assert (fresh_x["pool"], fresh_y["pool"]) == ("0", "h2:0")
    assert cached(fresh_x) == cached(fresh_y) == 0

    with first.gateway("--nodes", nodes) as by_prefix:
        again_y = complete_greedy(by_prefix.url, y)  # the second host first: no tie to win
        again_x = complete_greedy(by_prefix.url, x)
    assert (again_x["pool"], again_y["pool"]) == ("0", "h2:0")
    assert cached(again_x) == cached(again_y) == CACHED
    assert tokens(again_x) == tokens(fresh_x) and tokens(again_y) == tokens(fresh_y)
    rows = [pool_rows(first), pool_rows(second)]
    assert [row.prefix_hit_tokens for row in rows] == [CACHED, CACHED]
    assert [row.prefix_queried_tokens for row in rows] == [2 * PROMPT_TOKENS] * 2
    assert [(row.queued, row.queued_tokens) for row in rows] == [(0, 0), (0, 0)]


def test_each_hosts_own_gateway_serves_on_its_own_host(two_hosts: list[Stack]) -> None:
    """The second host's own gateway (``--node h2``) queues on that host's streams: its own
    worker answers, and the first host's pool never sees the request."""
    first, second = two_hosts
    rng = random.Random(38)
    prompt = [rng.randrange(256) for _ in range(PROMPT_TOKENS)]
    before = pool_rows(first).prefix_queried_tokens
    assert complete_greedy(second.url, prompt)["pool"] == "h2:0"
    assert complete_greedy(first.url, prompt)["pool"] == "0"  # and the first host's its own
    assert pool_rows(first).prefix_queried_tokens == before + PROMPT_TOKENS


def test_a_host_whose_kvstore_is_gone_is_left_out(two_hosts: list[Stack]) -> None:
    first, second = two_hosts
    gone = "ipc:///tmp/pagedserve-test-no-such-host.sock"
    rng = random.Random(37)
    prompts = [[rng.randrange(256) for _ in range(40)] for _ in range(4)]
    nodes = f"h3={gone},h2={second.endpoint}"
    with first.gateway("--nodes", nodes, "--routing", "round_robin") as gateway:
        answers = [complete_greedy(gateway.url, prompt) for prompt in prompts]
        assert "did not route" in gateway.output()
    assert sorted(a["pool"] for a in answers) == ["0", "0", "h2:0", "h2:0"]
    assert all(len(tokens(a)) == 12 for a in answers)


def test_node_names_are_checked_where_they_are_given() -> None:
    assert queue_keys.request_stream(2, "h2") == "pagedserve:requests:h2:2"
    for bad in ("2", "H2", "a:b", "", "x" * 33):
        with pytest.raises(ValueError, match="node name"):
            queue_keys.check_node(bad)
    assert GatewayConfig(nodes="h2=ipc:///a, h3=tcp://b:1").node_endpoints() == [
        ("h2", "ipc:///a"),
        ("h3", "tcp://b:1"),
    ]
    for bad in ("h2", "h2=", "h2=a,h2=b", "9=a"):
        with pytest.raises(ValueError):
            GatewayConfig(nodes=bad)
    with pytest.raises(ValueError, match="own host"):
        GatewayConfig(node="h2", nodes="h2=ipc:///a")
    with pytest.raises(ValueError, match="node name"):
        GatewayConfig(node="H2")
