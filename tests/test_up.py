"""`pagedserve up` (what `make serve` runs) brings the stack up and Ctrl-C takes it all down."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import redis
import redis.asyncio

from gateway import queue
from kvstore import protocol as p
from kvstore.client import KVClient
from tests.conftest import ROOT


def submit(redis_url: str, req_id: str, max_tokens: int) -> None:
    params = queue.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    record = queue.RequestRecord(req_id, [256, 72, 105], params, "tiny", time.time())

    async def go() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        await queue.submit(client, record)
        await client.aclose()

    asyncio.run(go())


def wait_final(
    r: redis.Redis, req_id: str, timeout_s: float = 60, poll_s: float = 0.1
) -> queue.Streamed:
    deadline = time.monotonic() + timeout_s
    while not (streamed := queue.read_streamed(r, req_id)).final:
        assert time.monotonic() < deadline, f"no final record for {req_id}"
        time.sleep(poll_s)
    return streamed


def test_up_serves_and_stops_on_ctrl_c() -> None:
    endpoint = f"ipc:///tmp/pagedserve-up-{uuid.uuid4().hex[:8]}.sock"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the embedded Redis
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "pagedserve.cli",
        "up",
        "--endpoint",
        endpoint,
        "--device",
        "cpu",
        "--kvstore-args",
        "--kv-memory 0.05GiB --swap-memory 0.01",
    ]
    signalled = False
    up = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        lines = []
        while time.monotonic() < deadline:
            line = up.stdout.readline()  # type: ignore[union-attr]
            lines.append(line)
            if "pagedserve is up" in line or not line:
                break
        assert "pagedserve is up" in lines[-1], "".join(lines)
        redis_url = lines[-1].split("redis ")[1].split(",")[0]
        with KVClient(endpoint, timeout_s=5) as client:
            assert len(client.call(p.GetStats()).workers) == 1
        # One request through the running stack: Redis -> the worker process -> Redis.
        r = redis.Redis.from_url(redis_url)
        submit(redis_url, "up-1", max_tokens=5)
        assert len(wait_final(r, "up-1").sequences[0].token_ids) == 5
        # Ctrl-C while a long request runs: the worker drains it before the stack stops.
        submit(redis_url, "up-2", max_tokens=300)
        deadline = time.monotonic() + 60
        while not queue.read_streamed(r, "up-2").sequences:
            assert time.monotonic() < deadline, "the worker never started up-2"
            time.sleep(0.05)
        up.send_signal(signal.SIGINT)
        signalled = True
        # The worker drains up-2 and publishes its last record before it exits; Redis stops
        # only after the worker and the kvstore did, so the final record can be read here.
        drained = wait_final(r, "up-2", poll_s=0.02)
        assert len(drained.sequences[0].token_ids) == 300, "not drained"
    finally:
        if not signalled:
            up.send_signal(signal.SIGINT)
        up.wait(120)
    log = up.stdout.read()  # type: ignore[union-attr]
    assert "draining 1 requests" in log, log
    worker_stopped = re.search(r"worker \S+ stopped", log)
    assert worker_stopped and "kvstore stopped" in log[worker_stopped.end() :], log
    assert not os.path.exists(endpoint.removeprefix("ipc://"))
    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()
        raise AssertionError("the embedded Redis is still running")
    except redis.ConnectionError:
        pass
