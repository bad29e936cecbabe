"""Serving requests through a real kvstore daemon, Redis and the worker's engine (in this
process: the real Engine code), for the engine tests."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import NamedTuple

import redis
import redis.asyncio

from compute.batch.scheduler import SchedulerConfig
from compute.loop.engine import Engine
from contracts import queue_gateway, queue_keys, queue_worker
from contracts.records import (
    RequestRecord,
    SamplingParams,
    Streamed,
)
from kvstore import protocol as p
from kvstore.client import KVClient
from tests.conftest import entry_record, start_kvstore, stop_process

BLOCK_BYTES = 8192  # tiny model, fp32, block 16: 2 layers x K,V x 16 x 2 heads x 16 x 4 bytes
PROFILE = [(16, 0.002), (1024, 0.05)]  # prefill seconds the worker reports (CPU, tiny)


class Served(NamedTuple):
    outputs: dict[str, list[int]]  # tokens of each request's first sequence
    stats: p.Stats  # the kvstore's, at the end
    cached: dict[str, int]  # cached tokens each request reported
    steps: int
    max_used: int  # most GPU blocks in use after any step
    streamed: dict[str, Streamed]  # every sequence of every request


def submit(redis_url: str, records: list[RequestRecord]) -> None:
    async def go() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        for record in records:
            await queue_gateway.submit(client, record)
        await client.aclose()

    asyncio.run(go())


def run_engine(
    redis_url: str,
    flags: list[str],
    prompts: dict[str, list[int]],
    max_tokens: int,
    tiny: tuple,
    max_num_seqs: int = 8,
    params: dict[str, SamplingParams] | None = None,
    salts: dict[str, bytes] | None = None,
    kv_model: str = "tiny",
    block_ms: int | None = 50,
    priorities: dict[str, int] | None = None,
    read_ahead: int = 0,
) -> Served:
    """Serves ``prompts`` to the end (greedy unless ``params`` says otherwise; ``priorities``:
    the requests', 0 if not given), stepping the engine with ``block_ms`` (None: a busy loop
    that never waits for requests)."""
    model, tokenizer, _ = tiny
    process, endpoint = start_kvstore("--model", kv_model, "--dtype", "float32", *flags)
    try:
        r = redis.Redis.from_url(redis_url)
        r.flushdb()
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        submit(
            redis_url,
            [
                RequestRecord(
                    rid,
                    prompt,
                    (params or {}).get(rid, greedy),
                    "tiny",
                    salt=(salts or {}).get(rid),
                    priority=(priorities or {}).get(rid, 0),
                )
                for rid, prompt in prompts.items()
            ],
        )
        with KVClient(endpoint) as kv:
            config = SchedulerConfig(max_num_seqs, 64, read_ahead=read_ahead)
            engine = Engine("w-test", model, tokenizer, kv, r, config, PROFILE)
            deadline = time.monotonic() + 120
            steps = max_used = 0
            while time.monotonic() < deadline:
                engine.step(block_ms=block_ms)
                steps += 1
                assert len(engine.active) <= config.max_held
                live = kv.call(p.GetStats(0))
                max_used = max(max_used, live.gpu.used)
                rows = {row.req_id: row for row in live.requests}
                assert_kvstore_holds_reported(engine, rows)
                streamed = {rid: queue_worker.read_streamed(r, rid) for rid in prompts}
                if all(s.final for s in streamed.values()) and engine.idle:
                    break
            stats = kv.call(p.GetStats())
        outputs = {rid: s.sequences[0].token_ids for rid, s in streamed.items()}
        cached = {}
        for rid in prompts:
            entries = r.xrange(queue_keys.output_key(rid))
            assert entries is not None
            cached[rid] = entry_record(entries[-1]).cached_tokens
        return Served(outputs, stats, cached, steps, max_used, streamed)
    finally:
        stop_process(process)


def assert_kvstore_holds_reported(engine: Engine, rows: dict[str, p.RequestRow]) -> None:
    """The kvstore (``rows``, its stats' requests) holds exactly the tokens the worker reported:
    those of its last Step, whose reply it has not applied yet, count (between the reply's two
    outcomes: accepted, or refused for lack of space)."""
    sent = engine.unanswered_reports
    for seq in engine.requests.running():
        upto = sent.get(seq.seq_id, seq.num_reported)
        assert seq.num_reported <= rows[seq.seq_id].tokens <= upto, seq.seq_id


def prompts_of(
    lengths: list[int], seed: int, shared: list[int] | None = None
) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {
        f"req{i}": (shared or []) + [rng.randrange(256) for _ in range(n)]
        for i, n in enumerate(lengths)
    }


class TakenOver(NamedTuple):
    streamed: Streamed  # the request's output, every sequence
    computed_by_w2: int  # tokens the second worker ran through the model
    stats: p.Stats  # the kvstore's, at the end


def kill_and_take_over(
    redis_url: str,
    tiny: tuple,
    prompt: list[int],
    params: SamplingParams,
    w1_dies: Callable[[Engine, Streamed], bool],
) -> TakenOver:
    """Worker w1 serves the request until ``w1_dies`` says so, then dies (it stops: no step,
    no heartbeat, no ack, exactly what the kvstore and Redis see of a SIGKILL). Worker w2 takes
    the request over and finishes it."""
    model, tokenizer, _ = tiny
    process, endpoint = start_kvstore(
        "--model", "tiny", "--dtype", "float32", "--kv-memory", "0.01GiB",
        "--lease-timeout-s", "0.5",
    )  # fmt: skip
    try:
        r = redis.Redis.from_url(redis_url)
        r.flushdb()
        submit(redis_url, [RequestRecord("crash", prompt, params, "tiny")])
        config = SchedulerConfig(8, 64)
        with KVClient(endpoint) as kv1, KVClient(endpoint) as kv2:
            w1 = Engine("w1", model, tokenizer, kv1, r, config, PROFILE, claim_idle_ms=1000)
            while not w1_dies(w1, queue_worker.read_streamed(r, "crash")):
                w1.step(block_ms=50)
            del w1
            w2 = Engine("w2", model, tokenizer, kv2, r, config, PROFILE, claim_idle_ms=1000)
            deadline = time.monotonic() + 60
            while not queue_worker.read_streamed(r, "crash").final:
                assert time.monotonic() < deadline, "w2 never finished the request"
                w2.step(block_ms=50)
            stats = kv2.call(p.GetStats())
        return TakenOver(queue_worker.read_streamed(r, "crash"), w2.tokens_computed, stats)
    finally:
        stop_process(process)
