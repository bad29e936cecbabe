"""`pagedserve up` (what `make serve` runs) brings the stack up and Ctrl-C takes it all down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

from kvstore import protocol as p
from kvstore.client import KVClient
from tests.conftest import ROOT


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
        "--kvstore-args",
        "--device cpu --kv-memory 0.05GiB --swap-memory 0.01",
    ]
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
            assert isinstance(client.call(p.Ping()), p.Pong)
        import redis

        assert redis.Redis.from_url(redis_url).ping()
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(30)
    log = up.stdout.read()  # type: ignore[union-attr]
    assert "kvstore stopped" in log, log
    assert not os.path.exists(endpoint.removeprefix("ipc://"))
    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()
        raise AssertionError("the embedded Redis is still running")
    except redis.ConnectionError:
        pass
