"""Many clients at once: aborted streams free their blocks, concurrent streams lose nothing."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import aiohttp
import redis

from contracts import queue_keys, queue_worker
from tests.conftest import entry_record
from tests.stack import (
    Stack,
    Streamed,
    run,
    sse_events,
    stream_completion,
)

CLIENTS = 200


def session() -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=600)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)


async def open_and_abandon(s: aiohttp.ClientSession, url: str, i: int) -> str:
    """Streams a long completion until its first token arrives, then drops the connection."""
    body = {"prompt": f"abandoned {i}", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    response = await s.post(f"{url}/v1/completions", json=body)
    assert response.status == 200
    async for event in sse_events(response):
        assert event != "[DONE]", "finished before it was abandoned"
        if event["choices"] and event["choices"][0]["text"]:
            response.close()  # the client goes away mid-stream
            return event["id"]
    raise AssertionError("stream ended without a token")


def test_200_streams_aborted_midway_leave_no_block_held(stack: Stack) -> None:
    async def scenario() -> list[str]:
        async with session() as s:
            clients = [open_and_abandon(s, stack.url, i) for i in range(CLIENTS)]
            return await asyncio.gather(*clients)

    ids = run(scenario())
    assert len(set(ids)) == CLIENTS
    cache = stack.wait_blocks_released(timeout_s=90)  # 200 x 3000 tokens would take many minutes
    assert cache["blocks"]["in_use"] == 0
    r = redis.Redis.from_url(stack.redis_url)
    assert r.xlen(queue_keys.REQUEST_STREAM) == 0  # every request acked
    finals = [queue_worker.read_streamed(r, req_id) for req_id in ids]
    assert all(f.final and f.sequences[0].finish_reason == "abort" for f in finals)
    assert max(len(f.sequences[0].token_ids) for f in finals) < 3000


def test_streams_closed_by_their_clients_leave_no_error_in_the_log(stack: Stack) -> None:
    """A handler whose client left is cancelled, or its next write fails: either way the
    gateway aborts the request with no traceback and no 500 in its log (a failed write logs
    one line)."""
    with stack.gateway() as gateway:

        async def scenario() -> list[str]:
            async with session() as s:
                return await asyncio.gather(
                    *(open_and_abandon(s, gateway.url, i) for i in range(8))
                )

        run(scenario())
        stack.wait_blocks_released(timeout_s=90)
        time.sleep(0.5)  # the handlers' last log lines
        log = gateway.output()
        assert "Traceback" not in log and "Error handling" not in log, log[-3000:]
        assert '/v1/completions HTTP/1.1" 500' not in log


def test_non_streaming_client_that_leaves_aborts_too(stack: Stack) -> None:
    """The worker is paused (SIGSTOP) while the client sends and leaves, so the request cannot
    finish first (the tiny model serves its 3000 tokens in about a second): the gateway must
    set its abort key, and the resumed worker end it with "abort"."""
    r = redis.Redis.from_url(stack.redis_url)
    aborted_before = set(r.scan_iter(match=queue_keys.abort_key("*")))
    workers = [w["pid"] for w in stack.admin("/admin/requests")["workers"]]
    queued_before = r.xlen(queue_keys.REQUEST_STREAM)  # pending entries stay until acked

    async def scenario() -> None:
        async with session() as s:
            body = {"prompt": "patience", "max_tokens": 3000, "ignore_eos": True}
            request = asyncio.create_task(s.post(f"{stack.url}/v1/completions", json=body))
            deadline = time.monotonic() + 30
            while r.xlen(queue_keys.REQUEST_STREAM) == queued_before:  # not queued yet
                assert time.monotonic() < deadline, "the gateway never queued the request"
                await asyncio.sleep(0.02)
            request.cancel()  # closes the connection before any answer
            while not set(r.scan_iter(match=queue_keys.abort_key("*"))) - aborted_before:
                assert time.monotonic() < deadline, "the gateway set no abort key"
                await asyncio.sleep(0.02)

    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        run(scenario())
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    stack.wait_blocks_released(timeout_s=60)
    [key] = set(r.scan_iter(match=queue_keys.abort_key("*"))) - aborted_before
    streamed = queue_worker.read_streamed(r, key.decode().removeprefix(queue_keys.abort_key("")))
    assert streamed.final and streamed.sequences[0].finish_reason == "abort"
    assert len(streamed.sequences[0].token_ids) < 3000


def published_text(r: redis.Redis, req_id: str) -> tuple[str, int]:
    """(text, tokens) the worker published for ``req_id``'s sequence 0."""
    entries = r.xrange(queue_keys.output_key(req_id))
    assert entries is not None
    mine = [entry_record(entry) for entry in entries]
    mine = [rec for rec in mine if rec.index == 0]
    return "".join(rec.text for rec in mine), sum(len(rec.token_ids) for rec in mine)


def test_200_concurrent_streams_all_complete_with_nothing_lost(stack: Stack) -> None:
    max_tokens = 16

    async def one(s: aiohttp.ClientSession, i: int) -> Streamed:
        body: dict[str, Any] = {
            "prompt": f"client {i}",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "seed": i,
            "stream_options": {"include_usage": True},
        }
        return await stream_completion(s, stack.url, body)

    async def scenario() -> list[Streamed]:
        async with session() as s:
            return await asyncio.gather(*(one(s, i) for i in range(CLIENTS)))

    results = run(scenario())
    r = redis.Redis.from_url(stack.redis_url)
    for result in results:
        assert result.status == 200 and result.done
        usage = result.events[-1]["usage"]
        assert usage["completion_tokens"] == max_tokens
        finishes = [c["finish_reason"] for e in result.events for c in e["choices"]]
        assert finishes[-1] == "length" and finishes.count("length") == 1
        # every delta the worker published reached the client, in order, exactly once
        text, tokens = published_text(r, result.events[0]["id"])
        assert tokens == max_tokens and result.text() == text
    stack.wait_blocks_released()
