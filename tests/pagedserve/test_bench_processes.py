"""`pagedserve bench --processes N` (the CLI, in its own processes) against a small fake
OpenAI-compatible streaming server, a real aiohttp server in a thread of the test: every seeded
request sent exactly once, by both client processes, merged into one result as one client's."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from pagedserve.bench_workloads import Lengths, TextMaker, build
from tests.conftest import ROOT


@dataclass
class FakeServer:
    """Streams ``max_tokens`` one-word chunks and the usage; records what it was sent."""

    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    senders: list[str] = field(default_factory=list)  # the X-Bench-Process header, if any

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.senders.append(request.headers.get("X-Bench-Process", ""))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(0.002)
            event = {"choices": [{"index": 0, "text": "w ", "finish_reason": None}]}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        usage = {
            "prompt_tokens": len(body["prompt"].split()),
            "completion_tokens": body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": 1},
        }
        last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage}
        await response.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
        return response


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/completions", server.completions)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    server.url = f"http://127.0.0.1:{port}"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def bench(fake: FakeServer, tmp_path: Path, *flags: str) -> tuple[dict[str, Any], str, str]:
    out = tmp_path / f"result-{len(list(tmp_path.iterdir()))}.json"
    command = [sys.executable, "-m", "pagedserve.cli", "bench", "--base-url", fake.url]
    command += ["--result-json", str(out), *flags]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), done.stdout, done.stderr


FLAGS = ["--num-requests", "16", "--input-len", "5:30", "--output-len", "3:12", "--seed", "7"]


def test_two_processes_send_every_request_once_and_report_as_one(
    fake: FakeServer, tmp_path: Path
) -> None:
    """``--processes 2`` with Poisson arrivals and a concurrency limit: the server gets the 16
    seeded prompts, each once, 8 from each process (round-robin); the result is one client's:
    every request and token counted, the requests in their order, each sent on the one schedule."""
    flags = [*FLAGS, "--processes", "2", "--request-rate", "40", "--max-concurrency", "3"]
    result, stdout, stderr = bench(fake, tmp_path, *flags)
    groups = build(
        "random", 16, Lengths(5, 30), Lengths(3, 12), 7, lambda rng: TextMaker(rng, None, 0)
    )
    prompts = [g[0].text for g in groups]
    assert sorted(b["prompt"] for b in fake.bodies) == sorted(prompts)  # each exactly once
    assert sorted(fake.senders) == ["0"] * 8 + ["1"] * 8
    by_prompt = {b["prompt"]: s for b, s in zip(fake.bodies, fake.senders, strict=True)}
    assert [by_prompt[p] for p in prompts] == [str(i % 2) for i in range(16)]  # round-robin
    assert (result["completed"], result["failed"]) == (16, 0)
    assert result["output_tokens"] == sum(g[0].max_tokens for g in groups)
    assert result["input_tokens"] == sum(len(p.split()) for p in prompts)
    assert result["cached_tokens"] == 16
    rows = result["requests"]
    assert [r["output_tokens"] for r in rows] == [g[0].max_tokens for g in groups]
    assert result["duration_s"] == max(r["end_s"] for r in rows)
    assert result["output_tok_s"] == pytest.approx(result["output_tokens"] / result["duration_s"])
    rng, at = random.Random(7 + 1), 0.0
    for row in rows:  # each request sent at its arrival on the global schedule, or later
        assert row["start_s"] >= at - 0.005
        at += rng.expovariate(40)
    assert result["config"]["processes"] == 2
    assert "completed 16, failed 0" in stdout
    assert stderr.splitlines()[-1].startswith("16/16 requests")  # the parent's merged progress


def test_one_process_result_keeps_its_keys(fake: FakeServer, tmp_path: Path) -> None:
    """``--processes 1`` (the default): one client, no process header, the result's fields as
    before ``--processes`` (the config records the flag)."""
    result, *_ = bench(fake, tmp_path, *FLAGS)
    assert set(fake.senders) == {""}
    assert (result["completed"], result["failed"]) == (16, 0)
    assert list(result) == [
        "config", "completed", "failed", "errors", "duration_s", "output_tokens",
        "input_tokens", "cached_tokens", "cached_fraction", "guided", "guided_parsed",
        "guided_cut", "output_tok_s", "input_tok_s", "request_s", "goodput_request_s",
        "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "requests",
    ]  # fmt: skip
    assert list(result["requests"][0]) == [
        "start_s", "end_s", "ttft_ms", "e2e_ms", "output_tokens", "prompt_tokens",
        "cached_tokens", "conversation", "turn", "guided", "finish_reason", "server_pool",
        "chunks_s", "tpot_ms", "error",
    ]  # fmt: skip
    assert result["config"]["processes"] == 1


def test_more_processes_than_the_concurrency_limit_is_refused(
    fake: FakeServer, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "pagedserve.cli", "bench", "--base-url", fake.url]
    command += [*FLAGS, "--processes", "3", "--max-concurrency", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--max-concurrency" in done.stderr
    assert not fake.bodies
