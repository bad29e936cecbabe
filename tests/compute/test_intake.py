"""``Intake.gone``: which gateways have been missing long enough for their requests to end
(pure bookkeeping over the times given; the engine's end of their requests is tested through
real gateways in ``tests/pagedserve/test_up_gateways.py``). Taking over: against a real Redis, a
worker takes over a dead worker's requests, never its own that were idle through a long step."""

from __future__ import annotations

import time

import redis

from compute.batch.admission import ModelLimits
from compute.batch.registry import Requests
from compute.batch.scheduler import Scheduler, SchedulerConfig
from compute.faults import Faults
from compute.loop.intake import GATEWAY_MISSING_S, Intake
from contracts import queue_worker
from contracts.tokenizer import load_tokenizer, output_decoder
from tests.pagedserve.test_up import submit

CLAIM_IDLE_MS = 300
LONG_STEP_S = 0.6  # longer than CLAIM_IDLE_MS: the entries of a worker that did not renew them


def intake() -> Intake:
    """No Redis and no requests are touched by ``gone``."""
    return Intake(
        None,  # type: ignore[arg-type]
        "w",
        1000,
        None,  # type: ignore[arg-type]
        lambda seq_ids: None,
        Faults(),
        ModelLimits(1, 1),
    )


def test_a_gateway_is_gone_once_missing_for_the_grace_period_and_only_once() -> None:
    watch = intake()
    assert watch.gone({"g1"}, now=100.0) == []  # first miss: maybe a Redis restart
    assert watch.gone({"g1", "g2"}, now=100.0 + GATEWAY_MISSING_S - 0.5) == []
    assert watch.gone({"g1", "g2"}, now=100.0 + GATEWAY_MISSING_S) == ["g1"]
    assert watch.gone({"g1", "g2"}, now=100.0 + GATEWAY_MISSING_S + 0.5) == []  # g1 re-armed
    # g2 was first missed 0.5 s before g1 went, g1 again 0.5 s after
    assert watch.gone({"g1", "g2"}, now=100.0 + 2 * GATEWAY_MISSING_S) == ["g2"]
    assert watch.gone({"g1"}, now=100.0 + 2 * GATEWAY_MISSING_S + 0.5) == ["g1"]


def test_a_gateway_seen_again_starts_its_grace_period_over() -> None:
    watch = intake()
    assert watch.gone({"g"}, now=0.0) == []
    assert watch.gone(set(), now=GATEWAY_MISSING_S - 1) == []  # its key is back
    assert watch.gone({"g"}, now=GATEWAY_MISSING_S) == []  # missing again: a new first miss
    assert watch.gone({"g"}, now=2 * GATEWAY_MISSING_S - 0.5) == []
    assert watch.gone({"g"}, now=2 * GATEWAY_MISSING_S) == ["g"]


def serving(r: redis.Redis) -> tuple[Intake, Requests]:
    """Worker "w"'s intake, with a request registry over the tiny model's tokenizer."""
    queue_worker.ensure_group(r)
    decode = output_decoder(load_tokenizer("tiny"))
    requests = Requests(Scheduler(SchedulerConfig(), 16), decode, {0}, "w")
    intake = Intake(
        r, "w", CLAIM_IDLE_MS, requests, lambda seq_ids: None, Faults(), ModelLimits(300, 300)
    )
    return intake, requests


def test_its_requests_read_but_not_started_are_not_taken_over_after_a_long_step(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Read by the worker's last Redis job, not started yet when a long step ends: started
    once, not taken over by the same worker as well."""
    intake, requests = serving(redis_client)
    submit(redis_url, "read", max_tokens=4)
    intake.incoming = queue_worker.read_requests(redis_client, "w", 8, None)
    time.sleep(LONG_STEP_S)
    intake.take(room=8, accepting=True, idle=False, block_ms=None)
    assert list(requests.active) == ["read"]


def test_its_ended_requests_are_not_taken_over_while_their_ack_is_on_its_way(
    redis_url: str, redis_client: redis.Redis
) -> None:
    intake, requests = serving(redis_client)
    submit(redis_url, "ended", max_tokens=4)
    intake.take(room=8, accepting=True, idle=True, block_ms=None)  # reads it, starts it
    assert list(requests.active) == ["ended"]
    requests.remove(requests.active["ended"])  # as the engine ends it: the ack goes out later
    time.sleep(LONG_STEP_S)
    intake.take(room=8, accepting=True, idle=False, block_ms=None)
    assert not requests.active


def test_a_dead_workers_requests_are_taken_over(redis_url: str, redis_client: redis.Redis) -> None:
    intake, requests = serving(redis_client)
    submit(redis_url, "orphan", max_tokens=4)
    assert len(queue_worker.read_requests(redis_client, "dead", 8, None)) == 1
    time.sleep(LONG_STEP_S)
    intake.take(room=8, accepting=True, idle=False, block_ms=None)
    assert list(requests.active) == ["orphan"]
    assert requests.adopts("orphan")  # its blocks are adopted at the kvstore, if kept
