"""The admin API, /metrics and /health: on the running stack, and on in-process apps whose
kvstore has no worker or does not exist (real Redis and kvstore processes, no mocks)."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.model_info import ModelInfo
from tests.conftest import start_kvstore, stop_process
from tests.gateway.test_bad_input import ok_completion, post
from tests.stack import ADMIN_TOKEN, Stack, run

ADMIN_ROUTES = [
    ("GET", "/admin/cache"),
    ("GET", "/admin/requests"),
    ("GET", "/admin/cost-model"),
    ("POST", "/admin/cache/reset"),
]


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
@pytest.mark.parametrize("token", [None, "wrong", ""])
def test_admin_needs_its_bearer_token(stack: Stack, method: str, path: str, token: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        stack.admin(path, method, token)
    assert err.value.code == 401
    assert err.value.headers["WWW-Authenticate"] == "Bearer"


def test_admin_pages(stack: Stack) -> None:
    status, _ = post(stack, "/v1/completions", ok_completion(prompt="admin " * 10, max_tokens=2))
    assert status == 200
    cache = stack.admin("/admin/cache?top=5")
    assert set(cache["blocks"]) == {"total", "free", "in_use", "cached", "swapped"}
    blocks = cache["blocks"]
    assert blocks["free"] + blocks["in_use"] + blocks["cached"] == blocks["total"]
    assert blocks["cached"] > 0  # the prompt's full blocks stay cached after it finished
    assert set(cache["prefix_cache"]) == {
        "lookups",
        "queried_tokens",
        "hit_tokens",
        "hit_rate",
        "miss_reasons",
    }
    assert set(cache["prefix_cache"]["miss_reasons"]) >= {"no_entry", "partial_block"}
    assert len(cache["top_prefixes"]) <= 5
    busy = cache["kvstore_busy_s"]  # the daemon's seconds: its steps took some
    assert busy["Step"] > 0 and busy["Register"] > 0 and all(s >= 0 for s in busy.values())
    live = stack.admin("/admin/requests")
    assert set(live) == {"requests", "workers", "queued"}
    [worker] = live["workers"]
    assert worker["idle_s"] < 10 and worker["device"] == "cpu"
    cost = stack.admin("/admin/cost-model")
    assert set(cost) == {
        "calibration",
        "prefill_profiles",
        "recompute_profiles",
        "decisions",
        "preemptions",
        "profile_origins",
    }
    assert cost["calibration"]["swap_out_gbps"] > 0  # the kvstore calibrated at startup
    [origin] = cost["profile_origins"].values()  # timed at its start-up, or an earlier one's
    assert origin["source"] in ("measured", "cached") and origin["measured_at"] > 0, origin
    # as many points as the worker's profile budget fit (the cheapest is always measured)
    assert all(len(points) >= 1 for points in cost["prefill_profiles"].values())
    [recompute] = cost["recompute_profiles"].values()  # (tokens, context, seconds) per forward
    assert (
        len(recompute) >= 1
        and {c for _, c, _ in recompute} >= {0}
        and all(s > 0 for *_, s in recompute)
    )
    stack.wait_blocks_released()
    reset = stack.admin("/admin/cache/reset", "POST")
    assert reset["reset_blocks"] == blocks["cached"] or reset["reset_blocks"] > 0
    assert stack.admin("/admin/cache")["blocks"]["cached"] == 0


def metric(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$"
    found = re.findall(pattern, text, re.MULTILINE)
    assert found, f"{name} {labels} missing"
    return float(found[0])


def test_metrics_count_what_happened(stack: Stack) -> None:
    def scrape() -> str:
        with urllib.request.urlopen(f"{stack.url}/metrics", timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            return response.read().decode()

    before = scrape()
    prompt = "metrics " * 8
    for _ in range(2):
        assert post(stack, "/v1/completions", ok_completion(prompt=prompt, max_tokens=3))[0] == 200
    after = scrape()
    p = "pagedserve:"
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count"):
        assert metric(after, p + name) - metric(before, p + name) == 2
    assert metric(after, p + "inter_token_latency_seconds_count") > metric(
        before, p + "inter_token_latency_seconds_count"
    )
    queried = metric(after, p + "prefix_cache_queries_total") - metric(
        before, p + "prefix_cache_queries_total"
    )
    hits = metric(after, p + "prefix_cache_hits_total") - metric(
        before, p + "prefix_cache_hits_total"
    )
    assert (queried, hits) == (2 * 65, 64)  # 65 tokens each; the second hits 4 full blocks
    assert metric(after, p + "request_success_total", 'finished_reason="length"') >= 2
    for kind in ("swap", "recompute"):
        assert metric(after, p + "num_preemptions_total", f'kind="{kind}"') >= 0
    assert 0 <= metric(after, p + "kv_cache_usage_perc") <= 1
    # the kvstore frees a finished request in the worker's next step, after its final record
    # went out: the gauge may still count it for a step
    deadline = time.monotonic() + 10
    while metric(after, p + "num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        after = scrape()
    assert metric(after, p + "num_requests_running") == 0
    assert metric(after, p + "num_requests_waiting") == 0
    assert metric(after, p + "kvstore_up") == 1
    step_s = 'activity="Step"'
    assert metric(after, p + "kvstore_busy_seconds_total", step_s) > metric(
        before, p + "kvstore_busy_seconds_total", step_s
    )


# ---------------------------------------------------------------- in-process apps
def with_app(
    redis_url: str, kvstore: str, token: str | None, body: Callable[[TestClient], Awaitable[Any]]
) -> Any:
    config = GatewayConfig(redis_url=redis_url, kvstore=kvstore, kvstore_timeout_s=0.5)
    app = create_app(config, ModelInfo.load(config), token)

    async def go() -> Any:
        async with TestClient(TestServer(app)) as client:
            return await body(client)

    return run(go())


async def health(client: TestClient) -> tuple[int, Any]:
    response = await client.get("/health")
    return response.status, await response.json()


def test_health_503_when_the_kvstore_is_down(redis_url: str) -> None:
    status, body = with_app(redis_url, "ipc:///tmp/pagedserve-nobody.sock", None, health)
    assert status == 503 and body["kvstore"] == "down" and body["redis"] == "up"
    assert any(d.startswith("kvstore") for d in body["down"])


def test_health_503_without_a_live_worker_and_admin_disabled(redis_url: str) -> None:
    process, endpoint = start_kvstore("--model", "tiny", "--no-calibrate", "--swap-memory", "0")

    async def body(client: TestClient) -> tuple[int, Any, int]:
        status, answer = await health(client)
        admin = await client.get("/admin/cache", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        return status, answer, admin.status

    try:
        status, answer, admin_status = with_app(redis_url, endpoint, None, body)
    finally:
        stop_process(process)
    assert status == 503 and answer["kvstore"] == "up"
    assert answer["workers"] == {"alive": 0, "registered": 0}
    assert any(d.startswith("workers") for d in answer["down"])
    assert admin_status == 403  # no PAGEDSERVE_ADMIN_TOKEN: the admin API is disabled
