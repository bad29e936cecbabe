"""The gateway tests' stack: real Redis, `pagedserve kvstore`, one `pagedserve compute` worker and
`pagedserve gateway`, as separate processes on CPU with the tiny model, shared by the package.

The stack uses its own Redis database (not 0) so the tests that flush database 0 do not touch it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pagedserve.cli import spawn_process
from pagedserve.redis_server import free_port
from tests.conftest import start_kvstore, stop_process

ADMIN_TOKEN = "test-admin-token"
MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class Stack:
    url: str
    redis_url: str
    endpoint: str
    logs: Path

    def admin(self, path: str, method: str = "GET", token: str | None = ADMIN_TOKEN) -> Any:
        """The admin API's JSON answer (raises urllib.error.HTTPError on a 4xx/5xx)."""
        request = urllib.request.Request(f"{self.url}{path}", method=method)
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def wait_blocks_released(self, timeout_s: float = 60) -> dict[str, Any]:
        """``/admin/cache`` once no block is in use and the kvstore holds no request."""
        deadline = time.monotonic() + timeout_s
        while True:
            cache = self.admin("/admin/cache")
            live = self.admin("/admin/requests")["requests"]
            if cache["blocks"]["in_use"] == 0 and not live:
                return cache
            assert time.monotonic() < deadline, (cache["blocks"], live[:3])
            time.sleep(0.2)


def wait_healthy(url: str, processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in processes), "a process of the stack exited"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not healthy after {timeout_s} s")


@pytest.fixture(scope="package")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("gateway-stack")
    url = redis_url.rsplit("/", 1)[0] + "/3"
    kvstore, endpoint = start_kvstore("--model", "tiny", "--kv-memory", "0.05GiB")
    port = free_port()
    worker_log = open(logs / "worker.log", "wb")  # noqa: SIM115 (open for the stack's life)
    gateway_log = open(logs / "gateway.log", "wb")  # noqa: SIM115
    common = ["--model", "tiny", "--redis-url", url, "--kvstore", endpoint]
    worker = spawn_process(
        "compute", [*common, "--device", "cpu"], stdout=worker_log, stderr=subprocess.STDOUT
    )
    env = {**os.environ, "PAGEDSERVE_ADMIN_TOKEN": ADMIN_TOKEN}
    gateway_flags = [*common, "--port", str(port), "--max-body-bytes", str(MAX_BODY_BYTES)]
    gateway = spawn_process(
        "gateway", gateway_flags, env=env, stdout=gateway_log, stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, [kvstore, worker, gateway], 180)
        yield Stack(base, url, endpoint, logs)
    finally:
        for process in (gateway, worker):
            if process.poll() is None:
                process.send_signal(2)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
        stop_process(kvstore)
        worker_log.close()
        gateway_log.close()


# ---------------------------------------------------------------- raw HTTP helpers
@dataclass
class Streamed:
    """A completions stream, read to its end."""

    status: int
    events: list[Any]  # decoded JSON events, in order
    done: bool  # ended with data: [DONE]

    def text(self, index: int = 0) -> str:
        chunks = [c for e in self.events if "choices" in e for c in e["choices"]]
        return "".join(c.get("text", "") for c in chunks if c["index"] == index)


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """The JSON events of an SSE response; "[DONE]" as the string."""
    async for raw in response.content:
        line = raw.strip()
        if not line:
            continue
        assert line.startswith(b"data: "), line
        data = line[len(b"data: ") :]
        yield "[DONE]" if data == b"[DONE]" else json.loads(data)


async def stream_completion(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> Streamed:
    async with session.post(f"{url}/v1/completions", json=body | {"stream": True}) as response:
        events, done = [], False
        async for event in sse_events(response):
            if event == "[DONE]":
                done = True
                break
            events.append(event)
        return Streamed(response.status, events, done)


def run(coro: Any) -> Any:
    return asyncio.run(coro)
