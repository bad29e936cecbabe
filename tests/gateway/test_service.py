"""The gateway as a service, with real processes: every request has a deadline and a stream
shows it is alive; a shutdown drains for exactly its timeout and then cuts with an error; an API
key; one line for a port in use; no filesystem path in /v1/models; huge prompts refused before
tokenizing, without stalling other streams; the requests of a dead gateway aborted by the
workers."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis

from contracts import queue_keys
from contracts.model_config import tiny_config
from contracts.tokenizer import byte_tokenizer
from pagedserve.procs import spawn_process
from tests.conftest import entry_record
from tests.stack import Stack, run, stream_completion

NO_WORKER_DB = 7  # a Redis database no worker reads: requests wait forever


def no_worker_url(stack: Stack) -> str:
    url = stack.redis_url.rsplit("/", 1)[0] + f"/{NO_WORKER_DB}"
    redis.Redis.from_url(url).flushdb()
    return url


async def raw_stream(url: str, body: dict[str, Any]) -> tuple[list[bytes], float]:
    """Every non-empty line of a streamed completion, and how long it took."""
    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=60)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{url}/v1/completions", json=body | {"stream": True}) as response,
    ):
        assert response.status == 200
        lines = [line.strip() async for line in response.content if line.strip()]
    return lines, time.monotonic() - start


def error_of(lines: list[bytes]) -> dict[str, Any]:
    events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1, lines
    return errors[0]


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_request_nobody_serves_ends_at_its_deadline_with_keepalives(stack: Stack) -> None:
    """No worker: a stream gets SSE comments while it waits, then an error event (code
    request_timeout) and [DONE] at its deadline; a non-streaming request a 504. Both are
    aborted in Redis."""
    url = no_worker_url(stack)
    flags = ("--request-timeout-s", "3", "--sse-keepalive-s", "0.5")
    with stack.gateway(*flags, redis_url=url) as gateway:
        body = {"model": "tiny", "prompt": "wait", "max_tokens": 4}
        lines, took = run(raw_stream(gateway.url, body))
        assert lines.count(b": keep-alive") >= 3, lines
        assert error_of(lines)["code"] == "request_timeout"
        assert lines[-1] == b"data: [DONE]"
        assert 2.5 < took < 10, took
        status, answer = post(gateway.url, body)
        assert status == 504 and answer["error"]["code"] == "request_timeout"
        aborts = redis.Redis.from_url(url).keys(queue_keys.abort_key("*"))
        assert len(aborts) == 2, aborts


def test_shutdown_drains_for_its_timeout_then_cuts_with_an_error(stack: Stack) -> None:
    """SIGTERM: a request that cannot finish gets exactly --shutdown-timeout-s, then an error
    event and [DONE]; the gateway exits 0 right after."""
    url = no_worker_url(stack)
    with stack.gateway("--shutdown-timeout-s", "2", redis_url=url) as gateway:

        async def scenario() -> tuple[list[bytes], float]:
            stream = asyncio.create_task(raw_stream(gateway.url, {"prompt": "x", "max_tokens": 4}))
            await asyncio.sleep(1.0)  # in flight
            gateway.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            lines, _ = await stream
            return lines, time.monotonic() - signalled

        lines, took = run(scenario())
        assert error_of(lines)["code"] == "server_shutdown"
        assert lines[-1] == b"data: [DONE]"
        assert 1.8 < took < 5, took
        assert gateway.process.wait(10) == 0
        assert "cut 1 requests still in flight after 2 s" in gateway.output()


def test_shutdown_lets_requests_in_flight_finish(stack: Stack) -> None:
    """A request that finishes within the drain completes normally; the gateway then exits at
    once, not at the end of the timeout."""
    with stack.gateway("--shutdown-timeout-s", "60") as gateway:

        async def scenario() -> tuple[list[bytes], float]:
            body = {"prompt": "drain", "max_tokens": 48, "ignore_eos": True}
            stream = asyncio.create_task(raw_stream(gateway.url, body))
            await asyncio.sleep(0.5)
            gateway.process.send_signal(signal.SIGTERM)
            lines, _ = await stream
            start = time.monotonic()
            await asyncio.to_thread(gateway.process.wait, 30)
            return lines, time.monotonic() - start

        lines, exit_after = run(scenario())
        assert lines[-1] == b"data: [DONE]"
        assert b'"finish_reason":"length"' in lines[-2]
        assert exit_after < 10, exit_after
        assert gateway.process.returncode == 0


def test_api_key(stack: Stack) -> None:
    """With PAGEDSERVE_API_KEY set, /v1/* answers 401 without the key or with another one;
    the OpenAI SDK with the key works; /health stays open."""
    with stack.gateway(env={"PAGEDSERVE_API_KEY": "sesame"}) as gateway:
        body = {"prompt": "key", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            status, answer = post(gateway.url, body, headers)
            assert status == 401 and answer["error"]["code"] == "invalid_api_key", headers
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sesame")
        assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="nope").models.list()
        with urllib.request.urlopen(f"{gateway.url}/health", timeout=10) as response:
            assert response.status == 200


def test_a_port_in_use_is_one_line(stack: Stack, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flags = ["--model", "tiny", "--redis-url", stack.redis_url, "--port", str(port)]
        process = spawn_process("gateway", flags, stdout=-1, stderr=-1)
        out, err = process.communicate(timeout=60)
    assert process.returncode != 0
    assert f"port {port} on 127.0.0.1 is in use" in err.decode()
    assert "Traceback" not in out.decode() + err.decode()


def test_models_list_no_filesystem_path(stack: Stack, tmp_path: Path) -> None:
    checkpoint = tmp_path / "secret-dir" / "my-model"
    tiny_config().save_pretrained(checkpoint)
    byte_tokenizer().save_pretrained(checkpoint)
    with stack.gateway("--model", str(checkpoint)) as gateway:
        with urllib.request.urlopen(f"{gateway.url}/v1/models", timeout=10) as response:
            text = response.read().decode()
        card = json.loads(text)["data"][0]
        assert card["id"] == card["root"] == "my-model"
        assert "secret-dir" not in text and str(tmp_path) not in text


def test_huge_prompts_are_refused_without_stalling_streams(stack: Stack) -> None:
    """Prompts of 900,000 characters (the body limit is 1 MiB) are refused before they are
    tokenized (context_length_exceeded) while a stream goes on without a pause."""

    async def scenario() -> tuple[list[float], list[tuple[int, str]]]:
        arrivals: list[float] = []

        async def stream() -> None:
            body = {"prompt": "s", "max_tokens": 150, "ignore_eos": True, "stream": True}
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{stack.url}/v1/completions", json=body) as response,
            ):
                async for line in response.content:
                    if line.startswith(b"data: "):
                        arrivals.append(time.monotonic())

        async def huge(session: aiohttp.ClientSession) -> tuple[int, str]:
            body = {"prompt": "y" * 900_000, "max_tokens": 2}
            async with session.post(f"{stack.url}/v1/completions", json=body) as response:
                return response.status, (await response.json())["error"]["code"]

        task = asyncio.create_task(stream())
        while not arrivals:
            await asyncio.sleep(0.01)
        async with aiohttp.ClientSession() as session:
            answers = await asyncio.gather(*(huge(session) for _ in range(20)))
        await task
        return arrivals, answers

    arrivals, answers = run(scenario())
    assert answers == [(400, "context_length_exceeded")] * 20
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert len(arrivals) > 20 and max(gaps) < 1.0, max(gaps)


def test_a_dead_gateways_requests_are_aborted_by_the_workers(stack: Stack) -> None:
    """A gateway SIGKILLed with streams in flight: its clients' connections end at once, and
    the worker aborts the requests once the gateway's liveness key expires (2 s here): their
    blocks come back and their output streams end with an error record."""
    with stack.gateway("--liveness-ttl-s", "2") as gateway:

        async def scenario() -> list[str]:
            async def one(session: aiohttp.ClientSession, i: int) -> str:
                # long enough to outlive the kill, the liveness TTL and the worker's 3 s of
                # grace: ~2,600 tokens are out by then on a 2-core CPU (3,000 was too few once
                # the kvstore's reply left the worker's step)
                body = {"prompt": f"dead {i}", "max_tokens": 4000, "ignore_eos": True}
                try:
                    streamed = await stream_completion(session, gateway.url, body)
                except aiohttp.ClientError as err:
                    return type(err).__name__
                return "done" if streamed.done else "cut"

            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                tasks = [asyncio.create_task(one(session, i)) for i in range(3)]
                await asyncio.sleep(1.5)  # the streams are flowing
                gateway.process.kill()
                return await asyncio.gather(*tasks)

        endings = run(scenario())
        assert "done" not in endings, endings
    stack.wait_blocks_released(timeout_s=30)
    r = redis.Redis.from_url(stack.redis_url)
    errors = []
    for key in r.scan_iter(queue_keys.output_key("*")):
        entries = r.xrevrange(key, count=1)
        assert entries is not None
        last = entry_record(entries[0])
        if last.error and "gateway" in last.error:
            errors.append(last.error)
    assert len(errors) == 3, errors


def test_the_worker_and_the_gateway_tune_their_collectors_before_serving(stack: Stack) -> None:
    """``contracts.heap.tune_gc_for_serving`` ran in both, once start-up was done (the worker
    registers with the kvstore, and so answers /health, a moment before it serves)."""
    for log in [stack.logs / "worker.log", *stack.logs.glob("gateway-*.log")]:
        deadline = time.monotonic() + 30
        while "garbage collector:" not in (text := log.read_text(errors="replace")):
            assert time.monotonic() < deadline, (log.name, text[-2000:])
            time.sleep(0.1)
        assert text.count("garbage collector:") == 1 and "start-up objects frozen" in text
