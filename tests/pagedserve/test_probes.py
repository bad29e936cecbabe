"""The health probes (`pagedserve/probe.py`) against real processes: a kvstore, a worker, a
gateway, and a stand-in HTTP server; run as a container healthcheck runs them (their compose
wiring: tests/e2e/test_compose_files.py)."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pagedserve import probe, procs
from pagedserve.redis_server import free_port
from tests.conftest import ROOT, start_kvstore, stop_process


def run_probe(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m pagedserve.probe ARGS``, as a healthcheck runs it."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "pagedserve.probe", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.fixture(scope="module")
def kvstore_endpoint() -> Iterator[str]:
    process, endpoint = start_kvstore(
        "--model", "tiny", "--kv-memory", "0.01GiB", "--swap-memory", "0", "--no-calibrate"
    )
    yield endpoint
    stop_process(process)


def test_probe_kvstore(kvstore_endpoint: str) -> None:
    result = run_probe("kvstore", kvstore_endpoint)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"healthy: kvstore {kvstore_endpoint}: up ")
    dead = f"ipc:///tmp/pagedserve-test-{uuid.uuid4().hex[:8]}.sock"  # nobody binds it
    start = time.monotonic()
    result = run_probe("kvstore", dead, "--timeout-s", "0.5")
    assert result.returncode == 1
    assert result.stderr == f"unhealthy: kvstore {dead}: no reply in 0.5 s\n"
    assert time.monotonic() - start < 5
    result = run_probe("kvstore", "not-an-endpoint")
    assert result.returncode == 1 and "unhealthy" in result.stderr


def wait_probe(timeout_s: float, *args: str) -> subprocess.CompletedProcess[str]:
    """Probes until healthy or ``timeout_s``; returns the last result."""
    deadline = time.monotonic() + timeout_s
    while (result := run_probe(*args)).returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    return result


@pytest.mark.slow  # the worker measures its prefill times before it registers (~12 s on CPU)
def test_probe_worker_and_gateway(kvstore_endpoint: str, redis_url: str) -> None:
    """A real worker with its default id ``{hostname}-{pid}``, as in a compute container, and
    a real gateway whose /health follows it."""
    assert run_probe("worker", kvstore_endpoint).returncode == 1  # none registered yet
    port = free_port()
    health = f"http://127.0.0.1:{port}/health"
    shared = ["--model", "tiny", "--kvstore", kvstore_endpoint, "--redis-url", redis_url]
    quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    gateway = procs.spawn_process(
        "gateway", [*shared, "--host", "127.0.0.1", "--port", str(port)], **quiet
    )
    worker = procs.spawn_process("compute", [*shared, "--device", "cpu"], **quiet)
    try:
        procs.wait_for_workers(kvstore_endpoint, 1, [worker, gateway], 90)
        result = run_probe("worker", kvstore_endpoint)
        assert result.returncode == 0, result.stderr
        assert f"worker {socket.gethostname()}-{worker.pid} " in result.stdout
        result = wait_probe(30, "gateway", health)
        assert result.returncode == 0, result.stderr
        result = run_probe("worker", kvstore_endpoint, "--worker-id", "someone-else")
        assert result.returncode == 1 and "not registered" in result.stderr
        # A hung worker (stopped): still registered, no longer stepping.
        worker.send_signal(signal.SIGSTOP)
        time.sleep(1.5)
        result = run_probe("worker", kvstore_endpoint, "--max-idle-s", "1")
        assert result.returncode == 1 and "silent for" in result.stderr
        worker.send_signal(signal.SIGCONT)
        assert wait_probe(5, "worker", kvstore_endpoint, "--max-idle-s", "1").returncode == 0
        worker.send_signal(signal.SIGINT)  # drains (nothing), unregisters
        worker.wait(60)
        result = run_probe("worker", kvstore_endpoint)
        assert result.returncode == 1 and "not registered" in result.stderr
        result = run_probe("gateway", health)
        assert result.returncode == 1 and f"gateway {health}: HTTP 503" in result.stderr
    finally:
        for process in (worker, gateway):
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.send_signal(signal.SIGINT)
                process.wait(60)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status = 200 if self.path == "/health" else 503
        self.send_response(status)
        self.end_headers()
        self.wfile.write(b"ok" if status == 200 else b"no worker")

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_probe_gateway() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert probe.main(["gateway", f"{base}/health"]) == 0
        result = run_probe("gateway", f"{base}/sick")
        assert result.returncode == 1 and "HTTP 503 no worker" in result.stderr
    finally:
        server.shutdown()
        server.server_close()
    assert probe.main(["gateway", f"{base}/health", "--timeout-s", "1"]) == 1  # nobody listens


def test_a_worker_that_lost_its_kvstore_stops_on_one_signal(redis_url: str) -> None:
    """While it retries the kvstore it holds no request: SIGTERM stops it at once (it used to
    wait for a second signal, retrying forever)."""
    kvstore, endpoint = start_kvstore(
        "--model", "tiny", "--kv-memory", "0.01GiB", "--swap-memory", "0", "--no-calibrate"
    )
    flags = ["--model", "tiny", "--kvstore", endpoint, "--redis-url", redis_url, "--device", "cpu"]
    worker = procs.spawn_process("compute", flags, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        procs.wait_for_workers(endpoint, 1, [worker, kvstore], 90)
        kvstore.kill()
        kvstore.wait(10)
        time.sleep(12)  # the worker's next call to the kvstore times out (10 s): it retries
        assert worker.poll() is None
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(15) == 0
        log = worker.stdout.read().decode() if worker.stdout else ""
        assert "lost the kvstore or Redis" in log and "not unregistering" in log, log[-2000:]
    finally:
        if worker.poll() is None:
            worker.kill()
        stop_process(kvstore)
