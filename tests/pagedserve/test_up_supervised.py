"""`pagedserve up` as a supervisor, end to end: killed children come back (a worker under its
id, the gateway on its port, redis-server on its port with its data), a child that keeps failing
makes `up` give up with status 1, and startup failures are one line."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from kvstore import protocol as p
from kvstore.client import KVClient
from pagedserve.redis_server import free_port
from tests.pagedserve.test_up import stream_one_completion, up_command, up_env


def wait_for(what: str, check: object, timeout_s: float, up: subprocess.Popen[bytes]) -> None:
    """Until ``check()`` is truthy; fails if ``up`` exits meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert up.poll() is None, f"up exited ({up.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def serves_again(example: str, log: Callable[[], str], timeout_s: float) -> None:
    """The printed example streams a completion, within ``timeout_s`` (tries again on errors:
    a 503 while the stack recovers, or a stream cut by a child that was restarted)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            assert len(stream_one_completion(example)) > 0
            return
        except (OSError, AssertionError) as err:
            assert time.monotonic() < deadline, f"{err!r}\n{log()}"
            time.sleep(1)


def worker_rows(endpoint: str) -> list[p.WorkerRow]:
    with KVClient(endpoint, timeout_s=5) as client:
        return list(client.call(p.GetStats(0)).workers)


def start_logged(
    command: list[str], log_path: Path
) -> tuple[subprocess.Popen[bytes], Callable[[], str]]:
    """`up` started with its output in ``log_path``, and a reader of that log so far."""
    with log_path.open("wb") as log_file:
        up = subprocess.Popen(command, env=up_env(), stdout=log_file, stderr=subprocess.STDOUT)
    return up, lambda: log_path.read_text(errors="replace")


def child_pids(up: subprocess.Popen[bytes], command: str) -> set[int]:
    """The pids of `up`'s live children running `pagedserve <command>`."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == up.pid and fields[0] != "Z" and command.encode() in argv:
            pids.add(int(stat.parent.name))
    return pids


def child_pid(up: subprocess.Popen[bytes], command: str) -> int | None:
    """The pid of `up`'s child running `pagedserve <command>` (None if there is none now)."""
    return min(child_pids(up, command), default=None)


def test_up_restarts_killed_children_keeps_redis_data_and_gives_up(tmp_path: Path) -> None:
    """One `up`: SIGKILL the worker: it comes back under the same id and the stack serves again;
    the gateway: the same; the redis-server: it comes back on the same port with a key written
    before the kill. Then the gateway is killed until `up` gives up: one error line naming it,
    everything stopped in order, exit status 1, the Redis directory kept."""
    endpoint = f"ipc:///tmp/pagedserve-up-{uuid.uuid4().hex[:8]}.sock"
    port, redis_dir, log_path = free_port(), tmp_path / "redis", tmp_path / "up.log"
    worker_id = f"{socket.gethostname()}-{port}-w0"
    policy = ["--restart-backoff-s", "0.5", "--max-restarts", "2", "--healthy-after-s", "600"]
    up, log = start_logged(up_command(port, endpoint, redis_dir, *policy), log_path)
    try:
        wait_for("the banner", lambda: "ids (" in log(), 120, up)
        banner = log()[log().index("pagedserve is up") :].splitlines()
        redis_url = banner[0].split("redis ")[1].split(",")[0]
        example = banner[2].removeprefix("try: ")
        assert f"ids ({worker_id})" in banner[3] and str(redis_dir) in banner[3], banner
        assert (redis_dir / "port").read_text().strip() == redis_url.split(":")[2].split("/")[0]
        [row] = worker_rows(endpoint)
        assert row.worker_id == worker_id
        r = redis.Redis.from_url(redis_url)
        r.set("written-before-the-kill", "kept")

        # A worker killed: restarted under its id (a new pid), and the stack serves again.
        os.kill(row.pid, signal.SIGKILL)

        def restarted() -> list[p.WorkerRow]:
            return [w for w in worker_rows(endpoint) if w.pid != row.pid]

        wait_for("the worker to come back", restarted, 120, up)
        assert [w.worker_id for w in restarted()] == [worker_id]
        assert f"worker {worker_id} (pid {row.pid}) exited with signal SIGKILL after" in log()
        assert "; restarting in 0.5 s (restart 1 of at most 2 in a row)" in log()
        serves_again(example, log, 120)

        # The gateway killed: restarted on the same port, with the same admin token.
        gateway_pid = child_pid(up, "gateway")
        assert gateway_pid is not None
        os.kill(gateway_pid, signal.SIGKILL)
        wait_for(
            "a new gateway", lambda: child_pid(up, "gateway") not in (None, gateway_pid), 30, up
        )
        serves_again(example, log, 120)
        assert f"gateway (pid {gateway_pid}) exited with signal SIGKILL" in log()

        # redis-server killed: restarted on the same port, reloads its append-only file.
        redis_pid = r.info("server")["process_id"]
        time.sleep(1.5)  # appendfsync everysec
        os.kill(redis_pid, signal.SIGKILL)

        def redis_back() -> bool:
            try:
                return r.info("server")["process_id"] != redis_pid
            except redis.ConnectionError:
                return False

        wait_for("redis to come back", redis_back, 60, up)
        assert r.get("written-before-the-kill") == b"kept"
        assert f"redis-server (pid {redis_pid}) exited with signal SIGKILL" in log()
        serves_again(example, log, 120)  # a worker that lost Redis reconnects or is restarted

        # The gateway killed again and again, never up for --healthy-after-s: `up` gives up.
        deadline = time.monotonic() + 60
        while up.poll() is None:
            assert time.monotonic() < deadline, log()
            pid = child_pid(up, "gateway")
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        up.wait(120)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(120)
            finally:
                if up.poll() is None:
                    up.kill()
    text = log()
    assert up.returncode == 1, text
    [giving_up] = [line for line in text.splitlines() if "giving up" in line]
    assert "ERROR pagedserve.supervisor: giving up: gateway (pid " in giving_up, giving_up
    assert "exited with signal SIGKILL" in giving_up and "(at most 2 restarts)" in giving_up
    worker_stopped = text.rindex(f"worker {worker_id} stopped")
    assert text.index("giving up") < worker_stopped < text.rindex("kvstore stopped"), text
    # (a child may print a traceback when it loses Redis: then it is restarted; `up` never does)
    assert "in run_up" not in text and "supervisor.py" not in text, text
    assert (redis_dir / "appendonly.aof").stat().st_size > 0
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()


def test_up_exits_with_one_line_when_the_port_is_taken_or_startup_fails(tmp_path: Path) -> None:
    """The gateway's port taken: nothing starts, one line, exit status 1. A child that fails
    during startup: one last line, exit 1, Redis stopped. SIGTERM during startup: exit 0."""
    endpoint = f"ipc:///tmp/pagedserve-up-{uuid.uuid4().hex[:8]}.sock"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        out = subprocess.run(
            up_command(port, endpoint, tmp_path / "redis"),
            env=up_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr == f"pagedserve up: port {port} on 127.0.0.1 is in use; pass --port\n"
    assert time.monotonic() - started < 30
    assert not (tmp_path / "redis").exists()  # nothing was started

    # The kvstore refuses its flags: up stops Redis and exits 1, the last line says why.
    cmd = up_command(free_port(), endpoint, tmp_path / "redis", "--kvstore-args", "--no-such 1")
    out = subprocess.run(cmd, env=up_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines()[-1] == (
        "pagedserve up: kvstore exited during startup (exit code 2)"
    ), out.stderr
    assert "Traceback" not in out.stderr
    redis_port = int((tmp_path / "redis" / "port").read_text())
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=redis_port, socket_connect_timeout=1).ping()

    # SIGTERM while the kvstore starts: every child stopped, exit status 0.
    log_path = tmp_path / "sigterm.log"
    with log_path.open("wb") as log_file:
        up = subprocess.Popen(
            up_command(free_port(), endpoint, tmp_path / "redis"),
            env=up_env(),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for("redis", lambda: "append-only file in" in log_path.read_text(), 60, up)
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0, log_path.read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert "stopping during startup" in log_path.read_text()
    assert child_pid(up, "kvstore") is None
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=redis_port, socket_connect_timeout=1).ping()
