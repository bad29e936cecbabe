"""`pagedserve up` (what `make serve` runs) brings the stack up and Ctrl-C takes it all down."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import redis
import redis.asyncio

from contracts import queue_gateway, queue_worker
from contracts.records import RequestRecord, SamplingParams, Streamed, StreamedSequence
from kvstore import protocol as p
from kvstore.client import KVClient
from pagedserve.procs import spawn_process
from pagedserve.redis_server import free_port
from tests.conftest import ROOT, banner_of


def submit(redis_url: str, req_id: str, max_tokens: int, prompt: list[int] | None = None) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    record = RequestRecord(req_id, prompt or [256, 72, 105], params, "tiny")

    async def go() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        await queue_gateway.submit(client, record)
        await client.aclose()

    asyncio.run(go())


def wait_final(r: redis.Redis, req_id: str, timeout_s: float = 60, poll_s: float = 0.1) -> Streamed:
    deadline = time.monotonic() + timeout_s
    while not (streamed := queue_worker.read_streamed(r, req_id)).final:
        assert time.monotonic() < deadline, f"no final record for {req_id}"
        time.sleep(poll_s)
    return streamed


def stream_one_completion(example: str) -> str:
    """Runs the curl command `pagedserve up` prints (its URL and body) with urllib; the text."""
    url = example.split("curl -N ")[1].split(" ")[0]
    body = example.split("-d '")[1].rstrip("'\n")
    request = urllib.request.Request(url, data=body.encode(), method="POST")
    text, done = [], False
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for raw in response:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for choice in json.loads(line[6:])["choices"]:  # completions' or chat's
                    text.append(
                        choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    )
    assert done
    return "".join(text)


def up_command(port: int, endpoint: str, redis_dir: Path, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pagedserve.cli",
        "up",
        "--endpoint",
        endpoint,
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--port",
        str(port),
        "--redis-dir",
        str(redis_dir),
        "--kvstore-args",
        "--kv-memory 0.05GiB --swap-memory 0.01",
        *flags,
    ]


def start_up(port: int, redis_dir: Path, model: Path, *flags: str) -> subprocess.Popen[str]:
    """``pagedserve up`` of checkpoint ``model`` on CPU (``up_command``'s flags and ``flags``),
    its output piped as text for ``banner_of``."""
    endpoint = f"ipc:///tmp/pagedserve-up-{uuid.uuid4().hex[:8]}.sock"
    cmd = up_command(port, endpoint, redis_dir, *flags)
    cmd[cmd.index("--model") + 1] = str(model)
    return subprocess.Popen(
        cmd, env=up_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def up_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "PAGEDSERVE_ADMIN_TOKEN")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_up_serves_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    endpoint = f"ipc:///tmp/pagedserve-up-{uuid.uuid4().hex[:8]}.sock"
    port = free_port()
    cmd = up_command(port, endpoint, tmp_path / "redis")
    signalled = False
    up = subprocess.Popen(
        cmd, env=up_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        banner = banner_of(up, 120)
        assert f"http://127.0.0.1:{port}" in banner
        redis_url = banner.split("redis ")[1].split(",")[0]
        token_line = up.stdout.readline()  # type: ignore[union-attr]
        example = up.stdout.readline()  # type: ignore[union-attr]
        assert token_line.startswith("admin token (PAGEDSERVE_ADMIN_TOKEN): "), token_line
        token = token_line.split(": ")[1].strip()
        # the printed example works as printed, the printed token opens the admin API
        assert len(stream_one_completion(example)) > 0
        admin = urllib.request.Request(f"http://127.0.0.1:{port}/admin/cache")
        admin.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(admin, timeout=10) as response:
            assert json.loads(response.read())["prefix_cache"]["lookups"] >= 1
        with KVClient(endpoint, timeout_s=5) as client:
            assert len(client.call(p.GetStats()).workers) == 1
        # One request through the running stack: Redis -> the worker process -> Redis.
        r = redis.Redis.from_url(redis_url)
        submit(redis_url, "up-1", max_tokens=5)
        assert len(wait_final(r, "up-1").sequences[0].token_ids) == 5
        # Ctrl-C while a long request runs: the worker drains it before the stack stops.
        submit(redis_url, "up-2", max_tokens=500)  # 3 + 500 of 512: outlasts the gateway's stop
        deadline = time.monotonic() + 60
        while not queue_worker.read_streamed(r, "up-2").sequences:
            assert time.monotonic() < deadline, "the worker never started up-2"
            time.sleep(0.05)
        up.send_signal(signal.SIGINT)
        signalled = True
        # The worker drains up-2 and publishes its last record before it exits; Redis stops
        # only after the worker and the kvstore did, so the final record can be read here.
        drained = wait_final(r, "up-2", poll_s=0.02)
        assert len(drained.sequences[0].token_ids) == 500, "not drained"
    finally:
        if not signalled:
            up.send_signal(signal.SIGINT)
        up.wait(120)
    log = up.stdout.read()  # type: ignore[union-attr]
    assert up.returncode == 0, log
    assert "draining 1 requests" in log, log
    worker_stopped = re.search(r"worker \S+ stopped", log)
    assert worker_stopped and "kvstore stopped" in log[worker_stopped.end() :], log
    assert "gateway stopped" in log[: worker_stopped.start()], log  # the gateway stops first
    assert not os.path.exists(endpoint.removeprefix("ipc://"))
    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()
        raise AssertionError("the embedded Redis is still running")
    except redis.ConnectionError:
        pass


def test_sigkill_a_worker_mid_generation_another_finishes_without_prefilling_again(
    redis_url: str,
) -> None:
    """Two real worker processes: A serves a request and is SIGKILLed mid-generation; B takes
    the request over from Redis, adopts the kvstore's blocks and finishes it. The output equals
    an uninterrupted run, and B computed only the tokens after A's last report, not the prompt."""
    from compute.model.models import load_model
    from tests.compute.driver import generate_greedy, reference_model
    from tests.conftest import start_kvstore, stop_process

    prompt = [(7 * i) % 256 for i in range(120)]
    kvstore, endpoint = start_kvstore(
        "--model", "tiny", "--lease-timeout-s", "1", "--kv-memory", "0.01GiB"
    )
    flags = [
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--kvstore",
        endpoint,
        "--redis-url",
        redis_url,
        "--claim-idle-ms",
        "1500",
    ]
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    worker_a = spawn_process("compute", [*flags, "--worker-id", "A"])
    worker_b = None
    try:
        submit(redis_url, "kill-1", max_tokens=120, prompt=prompt)
        deadline = time.monotonic() + 90
        while len(queue_worker.read_streamed(r, "kill-1").sequences.get(0, NONE).token_ids) < 10:
            assert time.monotonic() < deadline and worker_a.poll() is None, "A never streamed"
            time.sleep(0.05)
        worker_a.send_signal(signal.SIGKILL)
        worker_a.wait(10)
        streamed_by_a = len(queue_worker.read_streamed(r, "kill-1").sequences[0].token_ids)
        assert streamed_by_a < 120, "A finished before it was killed: nothing to take over"
        worker_b = spawn_process(
            "compute",
            [*flags, "--worker-id", "B"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        output = wait_final(r, "kill-1", timeout_s=120)
    finally:
        for worker in (worker_a, worker_b):
            if worker is not None and worker.poll() is None:
                worker.send_signal(signal.SIGINT)
                worker.wait(60)
        stop_process(kvstore)
    model, _ = load_model("tiny", "float32", "cpu")
    assert output.sequences[0].token_ids == generate_greedy(reference_model(model), prompt, 120)
    log_b = worker_b.stdout.read()  # type: ignore[union-attr]
    assert "taking over kill-1" in log_b, log_b
    computed = int(re.search(r"computed (\d+) tokens", log_b).group(1))  # type: ignore[union-attr]
    # B computes the rest of the output plus at most the last block again (the last token is
    # always recomputed for its logits, its whole block if that block was full and cached):
    # never the 120-token prompt.
    assert computed <= 120 - streamed_by_a + 16, (computed, streamed_by_a)


NONE = StreamedSequence([])
