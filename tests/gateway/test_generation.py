"""From output records to choice deltas: the gateway side of the Redis contract, real Redis.

The test plays the worker with the contract's own ``queue_worker.publish``; the gateway side is
the real ``Generation`` reading through the real ``OutputRouter``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio

from contracts import queue_keys, queue_worker
from contracts.records import OutputRecord, decode_request
from contracts.tokenizer import BOS
from gateway.config import GatewayConfig
from gateway.generation import Delta, Generation, GenerationError
from gateway.metrics import Metrics
from gateway.model_info import ModelInfo
from gateway.prepare import prepare_completion
from gateway.router import OutputRouter
from gateway.schemas import CompletionRequest

MODEL = ModelInfo.load(GatewayConfig())


@contextlib.asynccontextmanager
async def generation(url: str, req_id: str, **request: Any) -> AsyncIterator[Generation]:
    r = redis.asyncio.Redis.from_url(url)
    router = OutputRouter(r, block_ms=200)
    reader = asyncio.create_task(router.run())
    prepared = prepare_completion(
        CompletionRequest(prompt=request.pop("prompt", [BOS]), **request), MODEL, 8
    )
    gen = Generation(r, router, MODEL, prepared, req_id, Metrics("tiny"))
    await gen.submit()  # to no worker: the test publishes the outputs itself
    try:
        yield gen
    finally:
        await gen.close()
        await router.stop(reader)
        await r.aclose()


def record(req_id: str, index: int, tokens: list[int], text: str, **kw: Any) -> OutputRecord:
    return OutputRecord(req_id, index, tokens, prompt_tokens=1, text=text, **kw)


async def collect(gen: Generation) -> list[list[Delta]]:
    return [deltas async for deltas in gen.deltas()]


def texts(batches: list[list[Delta]], index: int = 0) -> list[str]:
    return [d.text for b in batches for d in b if d.index == index]


def test_the_workers_text_is_forwarded_as_released(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """Records whose tokens released no text (an incomplete character, the start of a possible
    stop string) make no delta; the stop reason comes with the last text."""

    async def scenario() -> tuple[list[list[Delta]], Any]:
        async with generation(redis_url, "fwd", max_tokens=20) as gen:
            queue_worker.publish(
                redis_client,
                [
                    record("fwd", 0, [0xC3], ""),
                    record("fwd", 0, [0xA9], "é", offset=1),
                    record("fwd", 0, [ord("o")], "", offset=2),
                    record("fwd", 0, [ord(" ")], "", offset=3),
                    record("fwd", 0, [ord("w")], "", finish_reason="stop", final=True, offset=4),
                ],
            )
            return await collect(gen), gen.usage()

    batches, usage = run(scenario())
    assert texts(batches) == ["é", ""]
    assert batches[-1][-1].finish_reason == "stop"
    assert (usage.prompt_tokens, usage.completion_tokens) == (1, 5)  # every sampled token


def test_prompts_and_n_map_to_choice_indices(redis_client: redis.Redis, redis_url: str) -> None:
    async def scenario() -> list[list[Delta]]:
        async with generation(redis_url, "multi", prompt=["a", "b"], n=2, max_tokens=2) as gen:
            for i in range(2):
                for k in range(2):
                    letter = chr(ord("A") + 2 * i + k)
                    queue_worker.publish(
                        redis_client,
                        [
                            record(f"multi-{i}", k, [1], letter),
                            record(f"multi-{i}", k, [1], letter, finish_reason="length", offset=1),
                        ],
                    )
                queue_worker.publish(redis_client, [OutputRecord(f"multi-{i}", 1, final=True)])
            return await collect(gen)

    batches = run(scenario())
    assert ["".join(texts(batches, c)) for c in range(4)] == ["AA", "BB", "CC", "DD"]
    assert redis_client.xlen(queue_keys.REQUEST_STREAM) == 2  # one request per prompt


def test_the_priority_travels_in_the_request_record(
    redis_client: redis.Redis, redis_url: str
) -> None:
    async def scenario() -> None:
        async with generation(redis_url, "urgent", priority=-7):
            pass

    run(scenario())
    entries: Any = redis_client.xrange(queue_keys.REQUEST_STREAM)
    [(_, fields)] = entries
    assert decode_request(fields[b"rec"]).priority == -7


def test_close_aborts_what_has_not_finished(redis_client: redis.Redis, redis_url: str) -> None:
    async def scenario() -> str:
        async with generation(redis_url, "leave", max_tokens=10) as gen:
            queue_worker.publish(redis_client, [record("leave", 0, [97], "a")])
            async for deltas in gen.deltas():
                return deltas[0].text  # the client leaves after its first delta
        return ""

    assert run(scenario()) == "a"
    assert redis_client.exists(queue_keys.abort_key("leave"))


def test_an_abort_record_ends_every_sequence(redis_client: redis.Redis, redis_url: str) -> None:
    async def scenario() -> list[list[Delta]]:
        async with generation(redis_url, "gone", n=2, max_tokens=10) as gen:
            queue_worker.publish(
                redis_client,
                [record("gone", 1, [97], "a"), OutputRecord("gone", 0, [], None, "abort")],
            )
            queue_worker.publish(redis_client, [OutputRecord("gone", final=True)])
            return await collect(gen)

    finishes = {d.index: d.finish_reason for b in run(scenario()) for d in b if d.finish_reason}
    assert finishes == {0: "abort", 1: "abort"}


def test_worker_error_raises(redis_client: redis.Redis, redis_url: str) -> None:
    async def scenario() -> None:
        async with generation(redis_url, "bad", max_tokens=10) as gen:
            error = OutputRecord("bad", finish_reason="error", error="boom", final=True)
            queue_worker.publish(redis_client, [error])
            await collect(gen)

    with pytest.raises(GenerationError, match="boom"):
        run(scenario())
    assert not redis_client.exists(queue_keys.abort_key("bad"))  # it ended: nothing to abort


async def queued(gen: Generation, records: int) -> None:
    """Until the router has handed ``records`` records to ``gen`` (none taken yet)."""
    while gen._inbox.qsize() < records:
        await asyncio.sleep(0.01)


def test_records_already_waiting_come_out_as_one_batch(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """A gateway that fell behind writes what waits for a request at once: one batch."""

    async def scenario() -> list[list[Delta]]:
        async with generation(redis_url, "lag", max_tokens=3) as gen:
            published = [record("lag", 0, [1], c, offset=i) for i, c in enumerate("ab")]
            published.append(
                record("lag", 0, [1], "c", finish_reason="length", final=True, offset=2)
            )
            queue_worker.publish(redis_client, published)
            await queued(gen, 3)
            return await collect(gen)

    batches = run(scenario())
    assert [[d.text for d in batch] for batch in batches] == [["a", "b", "c"]]
    assert batches[0][-1].finish_reason == "length"


def test_text_before_a_worker_error_still_comes_out(
    redis_client: redis.Redis, redis_url: str
) -> None:
    async def scenario() -> tuple[list[list[Delta]], BaseException | None]:
        async with generation(redis_url, "late", max_tokens=10) as gen:
            error = OutputRecord("late", finish_reason="error", error="boom", final=True)
            queue_worker.publish(redis_client, [record("late", 0, [1], "x"), error])
            await queued(gen, 2)
            batches: list[list[Delta]] = []
            try:
                async for deltas in gen.deltas():
                    batches.append(deltas)
            except GenerationError as err:
                return batches, err
            return batches, None

    batches, err = run(scenario())
    assert texts(batches) == ["x"] and err is not None and "boom" in str(err.error.message)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))
