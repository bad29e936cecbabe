"""A whole stack for tests: real Redis, `pagedserve kvstore`, one `pagedserve compute` worker and
`pagedserve gateway`, as separate processes on CPU with the tiny model (``running_stack``: the
``stack`` fixture of ``tests/gateway`` and of ``tests/pagedserve`` starts one per package), and
raw HTTP helpers to talk to its gateway.

A stack uses its own Redis database (not 0) so the tests that flush database 0 do not touch it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from pagedserve.procs import spawn_process
from pagedserve.redis_server import free_port
from tests.conftest import start_kvstore, stop_process

T = TypeVar("T")
ADMIN_TOKEN = "test-admin-token"
MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class Gateway:
    """A `pagedserve gateway` process of the tests."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass(frozen=True)
class Stack:
    url: str
    redis_url: str
    endpoint: str
    logs: Path
    model: str = "tiny"

    @contextlib.contextmanager
    def gateway(
        self, *flags: str, redis_url: str = "", env: dict[str, str] | None = None
    ) -> Iterator[Gateway]:
        """Another gateway on this stack (its Redis database unless ``redis_url``), once it
        answers HTTP (``/health`` may say 503); SIGINT, then SIGKILL, when done."""
        port = free_port()
        log = self.logs / f"gateway-{port}.log"
        common = ["--model", self.model, "--redis-url", redis_url or self.redis_url]
        flags = (*common, "--kvstore", self.endpoint, "--port", str(port), *flags)
        environment = {"PAGEDSERVE_ADMIN_TOKEN": ADMIN_TOKEN, **(env or {})}
        with open(log, "wb") as out:
            process = spawn_process(
                "gateway",
                list(flags),
                env={**os.environ, **environment},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        gateway = Gateway(process, f"http://127.0.0.1:{port}", log)
        try:
            wait_listening(gateway, 60)
            yield gateway
        finally:
            stop_process(process)

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


def wait_listening(gateway: Gateway, timeout_s: float) -> None:
    """Until the gateway answers ``/health`` at all (200 or 503)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert gateway.process.poll() is None, f"the gateway exited: {gateway.output()[-2000:]}"
        try:
            with urllib.request.urlopen(f"{gateway.url}/health", timeout=2):
                return
        except urllib.error.HTTPError:
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise AssertionError(f"{gateway.url} not listening after {timeout_s} s")


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


@contextlib.contextmanager
def running_stack(
    redis_url: str,
    logs: Path,
    db: int,
    kv_memory: str = "0.05GiB",
    *gateway_flags: str,
    model: str = "tiny",
    healthy_timeout_s: float = 180,
    kvstore_flags: Sequence[str] = (),
    compute_flags: Sequence[str] = (),
    pools: int = 1,
) -> Iterator[Stack]:
    """A whole stack on CPU (the kvstore, one worker per pool, one gateway) on Redis database
    ``db``, serving ``model`` (``tiny``, a checkpoint directory or a GGUF model, fp32), once
    healthy (``healthy_timeout_s``: a worker loads its model and measures its prefill times
    first). ``pools``: the kvstore's ``--data-parallel-size``; worker i (``w{i}``) serves pool i."""
    url = redis_url.rsplit("/", 1)[0] + f"/{db}"
    dtype = [] if model == "tiny" else ["--dtype", "float32"]
    kv_flags = ["--model", model, "--kv-memory", kv_memory, *dtype, *kvstore_flags]
    kvstore, endpoint = start_kvstore(*kv_flags, "--data-parallel-size", str(pools))
    common = ["--model", model, "--redis-url", url, "--kvstore", endpoint]
    workers, worker_logs = [], []
    for pool in range(pools):
        name = "worker.log" if pools == 1 else f"worker-{pool}.log"
        worker_logs.append(open(logs / name, "wb"))  # noqa: SIM115 (open for the stack's life)
        ids = [] if pools == 1 else ["--pool", str(pool), "--worker-id", f"w{pool}"]
        workers.append(
            spawn_process(
                "compute",
                [*common, "--device", "cpu", *dtype, *ids, *compute_flags],
                stdout=worker_logs[-1],
                stderr=subprocess.STDOUT,
            )
        )
    stack = Stack("", url, endpoint, logs, model)
    try:
        with stack.gateway("--max-body-bytes", str(MAX_BODY_BYTES), *gateway_flags) as gateway:
            wait_healthy(gateway.url, [kvstore, *workers, gateway.process], healthy_timeout_s)
            yield dataclasses.replace(stack, url=gateway.url)
    finally:
        for worker in workers:
            stop_process(worker)
        stop_process(kvstore)
        for log in worker_logs:
            log.close()


# ---------------------------------------------------------------- raw HTTP helpers
def post_completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST {url}/v1/completions`` of ``body``, its JSON answer (raises
    urllib.error.HTTPError on a 4xx/5xx)."""
    return _post_completion(url, body)[0]


def complete_greedy(url: str, prompt: list[int], model: str = "tiny") -> dict[str, Any]:
    """A greedy 12-token completion of ``prompt`` (token ids) with its tokens' logprobs, and
    the pool that served it (the ``X-PagedServe-Pool`` header) under ``"pool"``."""
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0}
    answer, pool = _post_completion(url, body)
    return {**answer, "pool": pool}


def _post_completion(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The JSON answer and the ``X-PagedServe-Pool`` header of ``POST {url}/v1/completions``."""
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer, response.headers.get("X-PagedServe-Pool", "")


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
        if not line or line.startswith(b":"):  # blank, or an SSE comment (a keep-alive)
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


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)
