"""How soon the work of a dead process moves on, with every flag at its default: real processes
(Redis, the kvstore, two workers, a gateway; CPU, the tiny model), each death a SIGKILL that
nothing restarts.

- A dead worker: the other takes its request over once the kvstore's lease (its failure
  detector, ``kvstore.protocol.LEASE_TIMEOUT_S``) has run out, not after a fixed Redis idle time
  of its own (it was 30 s).
- A dead gateway: the workers end its requests once its liveness key (``GATEWAY_TTL_S``, renewed
  every third of it) has been missing ``GATEWAY_MISSING_S`` (it was 30 + 5 s).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from compute.loop.intake import GATEWAY_MISSING_S
from contracts import queue_keys, queue_worker
from contracts.queue_keys import GATEWAY_TTL_S
from contracts.records import StreamedSequence
from kvstore import protocol as p
from kvstore.client import KVClient
from pagedserve.procs import spawn_process
from pagedserve.redis_server import free_port
from tests.conftest import entry_record, start_kvstore, stop_process
from tests.pagedserve.test_up import submit
from tests.stack import Gateway, wait_healthy, wait_listening

BOUND_S = 25.0  # generous for a loaded 2-core machine; the fixed times were 30 s and 35 s
NONE = StreamedSequence([])


@dataclass
class Stack:
    redis_url: str
    endpoint: str
    workers: dict[str, subprocess.Popen[bytes]]
    logs: Path

    def rows(self) -> list[p.WorkerRow]:
        with KVClient(self.endpoint, timeout_s=10) as client:
            return list(client.call(p.GetStats(0)).workers)


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The kvstore and two workers, A and B, all with default flags, on Redis database 5."""
    url = redis_url.rsplit("/", 1)[0] + "/5"
    redis.Redis.from_url(url).flushdb()
    logs = tmp_path_factory.mktemp("failure-detection")
    kvstore, endpoint = start_kvstore("--model", "tiny", "--kv-memory", "0.02GiB")
    workers: dict[str, subprocess.Popen[bytes]] = {}
    flags = ["--device", "cpu", "--kvstore", endpoint, "--redis-url", url]
    try:
        for name in ("A", "B"):
            with (logs / f"worker-{name}.log").open("wb") as out:
                workers[name] = spawn_process(
                    "compute", [*flags, "--worker-id", name], stdout=out, stderr=subprocess.STDOUT
                )
        running = Stack(url, endpoint, workers, logs)
        deadline = time.monotonic() + 300  # each worker measures its prefill times first
        while {row.worker_id for row in running.rows()} != {"A", "B"}:
            assert all(w.poll() is None for w in workers.values()), "a worker exited"
            assert time.monotonic() < deadline, "the workers did not register"
            time.sleep(0.5)
        yield running
    finally:
        for worker in workers.values():
            if worker.poll() is None:
                stop_process(worker)
        stop_process(kvstore)


def streamed(r: redis.Redis, req_id: str) -> int:
    return len(queue_worker.read_streamed(r, req_id).sequences.get(0, NONE).token_ids)


def test_a_dead_workers_request_is_taken_over_by_the_other(stack: Stack) -> None:
    r = redis.Redis.from_url(stack.redis_url)
    submit(stack.redis_url, "orphaned", max_tokens=3000, prompt=[(5 * i) % 256 for i in range(40)])
    deadline = time.monotonic() + 120
    while streamed(r, "orphaned") < 10:
        assert time.monotonic() < deadline, "the request never streamed"
        time.sleep(0.05)
    [serving] = [row for row in stack.rows() if row.requests]
    [other] = [name for name in stack.workers if name != serving.worker_id]
    before = streamed(r, "orphaned")
    stack.workers[serving.worker_id].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    while streamed(r, "orphaned") <= before + 1:  # a token or two may be on their way
        assert time.monotonic() - killed_at < BOUND_S, "not taken over"
        time.sleep(0.05)
    took = time.monotonic() - killed_at
    print(f"worker {serving.worker_id} killed: {other} streamed on after {took:.1f} s")
    assert "taking over orphaned" in (stack.logs / f"worker-{other}.log").read_text()
    assert took < BOUND_S
    stack.workers[serving.worker_id].wait(10)
    r.set(queue_keys.abort_key("orphaned"), b"1", ex=60)  # the client is done with it


def test_a_dead_gateways_request_is_ended(stack: Stack) -> None:
    """After the worker test: the one worker left serves it."""
    assert GATEWAY_TTL_S + GATEWAY_MISSING_S <= 10
    port = free_port()
    log = stack.logs / "gateway.log"
    with log.open("wb") as out:
        process = spawn_process(
            "gateway",
            ["--redis-url", stack.redis_url, "--kvstore", stack.endpoint, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    gateway = Gateway(process, f"http://127.0.0.1:{port}", log)
    try:
        wait_listening(gateway, 120)
        wait_healthy(gateway.url, [process], 120)
        body = {"prompt": "gone", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        request = urllib.request.Request(
            f"{gateway.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            events = 0
            for raw in response:
                if raw.startswith(b"data: {"):
                    req_id = json.loads(raw[6:])["id"]
                    events += 1
                if events >= 5:
                    break
            process.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
        r = redis.Redis.from_url(stack.redis_url)
        while not queue_worker.read_streamed(r, req_id).final:
            assert time.monotonic() - killed_at < BOUND_S, "its request runs on"
            time.sleep(0.1)
        took = time.monotonic() - killed_at
        print(f"gateway killed: its request ended after {took:.1f} s")
        entries = r.xrange(queue_keys.output_key(req_id))
        assert entries, "no output stream"
        last = entry_record(entries[-1])
        assert last.finish_reason == "error" and "is gone" in (last.error or ""), last
        assert took < BOUND_S
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
