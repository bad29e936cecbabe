"""The latency the HTTP gateway adds, against reading the Redis contract directly.

An instant worker (a separate process speaking the Redis contract, ``contracts.queue_worker``,
no model) answers each request
with ``--tokens`` printable byte tokens (and their text), one record every ``--interval-ms``, and
notes when it published each. The same requests are then served two ways, one at a time:

* direct: ``queue_gateway.submit`` + ``queue_gateway.stream_output`` (what a client of Redis
  itself would see);
* gateway: ``POST /v1/completions`` with ``stream: true`` to a real ``pagedserve gateway``
  process, reading the SSE chunks (one per token: each byte is one character).

Reported: time to first token (request sent -> first token read) and token delivery latency
(worker published -> client read), p50 / p90 / p99, and the difference. The difference is what
the gateway costs: HTTP parsing, validation, tokenization, its Redis round trips (submit, wake,
the shared XREAD), JSON and SSE writing.

    python bench/gateway_latency.py [--requests 200] [--tokens 16] [--interval-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
import urllib.request
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp
import redis
import redis.asyncio

from contracts import queue_gateway, queue_worker
from contracts.records import OutputRecord, RequestRecord, SamplingParams
from pagedserve.procs import spawn_process
from pagedserve.redis_server import EmbeddedRedis, free_port


def instant_worker(url: str, interval_s: float, stop: Connection) -> None:
    """Serves requests without a model; sends back {(req_id, k): publish time}."""
    r = redis.Redis.from_url(url)
    queue_worker.ensure_group(r)
    published: dict[tuple[str, int], float] = {}
    while not stop.poll():
        for entry_id, record in queue_worker.read_requests(r, "bench", count=1, block_ms=50):
            n = record.params.max_tokens
            for k in range(n):
                token = ord("a") + k % 26
                last = k == n - 1
                rec = OutputRecord(
                    record.req_id,
                    0,
                    [token],
                    finish_reason="length" if last else None,
                    prompt_tokens=len(record.prompt_token_ids),
                    final=last,
                    text=chr(token),
                    offset=k,
                )
                published[(record.req_id, k)] = time.perf_counter()
                queue_worker.step(r, [rec], [entry_id] if last else [])
                if not last:
                    time.sleep(interval_s)
    stop.send(published)


async def direct(url: str, n: int, tokens: int) -> tuple[list[float], dict[tuple[str, int], float]]:
    r = redis.asyncio.Redis.from_url(url)
    ttft, arrived = [], {}
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for i in range(n):
        req_id = f"direct-{i}"
        sent = time.perf_counter()
        await queue_gateway.submit(r, RequestRecord(req_id, [256, 104, 105], params, "tiny"))
        k = 0
        async for record in queue_gateway.stream_output(r, req_id):
            for _ in record.token_ids:
                now = time.perf_counter()
                if k == 0:
                    ttft.append(now - sent)
                arrived[(req_id, k)] = now
                k += 1
    await r.aclose()
    return ttft, arrived


async def via_gateway(
    base: str, n: int, tokens: int
) -> tuple[list[float], dict[tuple[str, int], float]]:
    ttft, arrived = [], {}
    body = {"model": "tiny", "prompt": "hi", "max_tokens": tokens, "stream": True}
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            sent = time.perf_counter()
            k = 0
            async with s.post(f"{base}/v1/completions", json=body) as response:
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    if not event["choices"] or not event["choices"][0]["text"]:
                        continue
                    now = time.perf_counter()
                    if k == 0:
                        ttft.append(now - sent)
                    arrived[(event["id"], k)] = now
                    k += 1
    return ttft, arrived


def percentiles(values: list[float]) -> str:
    q = statistics.quantiles([v * 1000 for v in values], n=100, method="inclusive")
    return f"p50 {q[49]:7.3f} ms  p90 {q[89]:7.3f} ms  p99 {q[98]:7.3f} ms"


def delivery(
    arrived: dict[tuple[str, int], float], published: dict[tuple[str, int], float]
) -> list[float]:
    return [t - published[key] for key, t in arrived.items() if key in published]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--interval-ms", type=float, default=5.0)
    args = parser.parse_args()
    server = EmbeddedRedis.start()
    port = free_port()
    gateway = spawn_process(
        "gateway",
        ["--redis-url", server.url, "--port", str(port), "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    here, there = mp.Pipe()
    worker = mp.get_context("spawn").Process(
        target=instant_worker, args=(server.url, args.interval_ms / 1000, there)
    )
    worker.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/v1/models", timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.2)
        asyncio.run(via_gateway(base, 10, args.tokens))  # warm-up
        d_ttft, d_arrived = asyncio.run(direct(server.url, args.requests, args.tokens))
        g_ttft, g_arrived = asyncio.run(via_gateway(base, args.requests, args.tokens))
        here.send(None)
        published = here.recv()
    finally:
        worker.join(10)
        gateway.terminate()
        gateway.wait(30)
        server.stop()
    d_tok, g_tok = delivery(d_arrived, published), delivery(g_arrived, published)
    print(f"{args.requests} sequential streamed requests x {args.tokens} tokens")
    print(f"time to first token, direct Redis : {percentiles(d_ttft)}")
    print(f"time to first token, via gateway  : {percentiles(g_ttft)}")
    print(f"token delivery,      direct Redis : {percentiles(d_tok)}")
    print(f"token delivery,      via gateway  : {percentiles(g_tok)}")
    ttft_added = statistics.median(g_ttft) - statistics.median(d_ttft)
    token_added = statistics.median(g_tok) - statistics.median(d_tok)
    print(f"gateway adds (p50): {ttft_added * 1000:.3f} ms to the first token,")
    print(f"                    {token_added * 1000:.3f} ms to the delivery of each token")


if __name__ == "__main__":
    main()
