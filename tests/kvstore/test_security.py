"""The kvstore's access control, through real daemon processes: the shared-secret token, the
tcp rule, the private ipc socket and its directory, and the /dev/shm pool file."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest

from contracts.endpoints import DEFAULT_ENDPOINT, TOKEN_ENV, default_endpoint, runtime_dir
from gateway.kvclient import AsyncKVClient
from kvstore import protocol as p
from kvstore.client import KVClient, KVStoreError
from pagedserve.procs import spawn_kvstore
from tests.conftest import ROOT, stop_process

SMALL = ["--device", "cpu", "--kv-memory", "0.01GiB", "--swap-memory", "0", "--no-calibrate"]
TOKEN = secrets.token_urlsafe(24)


@dataclass
class TokenDaemon:
    endpoint: str
    process: subprocess.Popen[bytes]
    refused: int = 0  # unauthorized calls the tests made
    started: float = field(default_factory=time.monotonic)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_without_token(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def kvstore_cmd(endpoint: str, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pagedserve.cli",
        "kvstore",
        "--endpoint",
        endpoint,
        *SMALL,
        *flags,
    ]


def run_refused(cmd: list[str], env: dict[str, str]) -> list[str]:
    """Runs a kvstore that must refuse to start; returns its stderr lines."""
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode != 0, done
    assert time.monotonic() - start < 20  # before any allocation
    assert "Traceback" not in done.stderr + done.stdout
    return done.stderr.strip().splitlines()


def spawn(endpoint: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return spawn_kvstore(
        endpoint, SMALL, 60, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


@pytest.fixture(scope="module")
def token_daemon() -> Iterator[TokenDaemon]:
    """A kvstore on tcp with a token (spawn_kvstore's readiness ping reads it from our env)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TOKEN_ENV, TOKEN)
        process = spawn(endpoint, {**os.environ})
    daemon = TokenDaemon(endpoint, process)
    yield daemon
    log = stop_process(process)
    assert process.returncode == 0, log
    assert TOKEN not in log and "Traceback" not in log
    # Refusals are logged, but rate-limited: a few lines whose counts add up to every refusal.
    counts = [int(n) for n in re.findall(r"refused (\d+) unauthorized call", log)]
    most_lines = 2 + (time.monotonic() - daemon.started) / 10  # REFUSAL_LOG_INTERVAL_S
    assert sum(counts) == daemon.refused and len(counts) <= most_lines, log


@pytest.fixture
def authorized(token_daemon: TokenDaemon) -> Iterator[KVClient]:
    with KVClient(token_daemon.endpoint, timeout_s=10, token=TOKEN) as client:
        yield client


def refused(daemon: TokenDaemon, body: p.Request, token: str | None) -> None:
    with (
        KVClient(daemon.endpoint, timeout_s=10, token=token) as client,
        pytest.raises(KVStoreError, match=f"unauthorized.*{TOKEN_ENV}") as info,
    ):
        client.call(body)
    assert info.value.code == "unauthorized"
    daemon.refused += 1


def test_calls_without_the_token_are_refused_and_change_nothing(
    token_daemon: TokenDaemon, authorized: KVClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    authorized.call(p.Register("w-sec", [(16, 0.001)], "cpu", 1))
    authorized.call(p.Step("w-sec", admits=[p.AdmitItem("r1", list(range(100, 140)))]))
    for token in (None, "", "wrong", TOKEN[:-1], TOKEN + "x"):  # None: from the (empty) env
        refused(token_daemon, p.Unregister("w-sec"), token)
    refused(token_daemon, p.Step("w-sec", frees=["r1"]), "wrong")
    refused(token_daemon, p.ResetCache(), None)
    refused(token_daemon, p.Register("w-evil"), "")
    stats = authorized.call(p.GetStats())
    assert [w.worker_id for w in stats.workers] == ["w-sec"]
    assert [(r.req_id, r.worker, r.orphaned) for r in stats.requests] == [("r1", "w-sec", False)]
    assert isinstance(authorized.call(p.Heartbeat("w-sec")), p.Ack)  # still registered
    authorized.call(p.Step("w-sec", frees=["r1"]))
    authorized.call(p.Unregister("w-sec"))


def test_the_token_comes_from_the_environment(
    token_daemon: TokenDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with KVClient(token_daemon.endpoint, timeout_s=10) as client:
        assert isinstance(client.call(p.Ping()), p.Pong)

    async def gateway_calls() -> None:
        kv = AsyncKVClient(token_daemon.endpoint, timeout_s=10)
        assert isinstance(await kv.stats(), p.Stats)
        kv.close()
        bad = AsyncKVClient(token_daemon.endpoint, timeout_s=10, token="wrong")
        with pytest.raises(KVStoreError, match="unauthorized"):
            await bad.stats()
        bad.close()

    asyncio.run(gateway_calls())
    token_daemon.refused += 1


def test_an_old_client_gets_a_version_error_and_a_flood_is_logged_once(
    token_daemon: TokenDaemon,
) -> None:
    with KVClient(token_daemon.endpoint, timeout_s=10, token="") as client:
        v1 = msgspec.msgpack.encode([1, 7, ["Ping"]])  # protocol 1: no token field
        reply = client.call_raw(v1)
        assert isinstance(reply.body, p.Error) and reply.body.code == "version"
        frame = p.encode(p.Call(p.PROTOCOL_VERSION, 8, p.ResetCache(), "guess"))
        for _ in range(200):
            body = client.call_raw(frame).body
            assert isinstance(body, p.Error) and body.code == "unauthorized"
    token_daemon.refused += 200  # the fixture checks the log: a line or two, not 200


@pytest.mark.parametrize("with_token", [True, False])
def test_probe_needs_the_token(token_daemon: TokenDaemon, with_token: bool) -> None:
    env = env_without_token(**({TOKEN_ENV: TOKEN} if with_token else {}))
    cmd = [sys.executable, "-m", "pagedserve.probe", "kvstore", token_daemon.endpoint]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    if with_token:
        assert done.returncode == 0 and done.stdout.startswith("healthy: kvstore"), done
    else:
        token_daemon.refused += 1
        assert done.returncode == 1 and done.stderr.strip() == (
            f"unhealthy: kvstore {token_daemon.endpoint}: unauthorized: "
            f"set {TOKEN_ENV} to the kvstore's token"
        )
    assert TOKEN not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("endpoint", "what"),
    [
        ("tcp://127.0.0.1:{port}", "a tcp:// endpoint"),
        ("ipc://@pagedserve-test", "an abstract ipc://@ socket"),  # no file, no permissions
    ],
)
def test_a_network_endpoint_without_a_token_is_refused(endpoint: str, what: str) -> None:
    lines = run_refused(kvstore_cmd(endpoint.format(port=free_port())), env_without_token())
    assert lines == [
        f"pagedserve kvstore: {what} needs {TOKEN_ENV} set (a shared secret), "
        "or use an ipc:// endpoint"
    ]


def test_a_tcp_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        lines = run_refused(kvstore_cmd(endpoint), env_without_token(**{TOKEN_ENV: "t"}))
    assert lines == [
        f"pagedserve kvstore: cannot bind {endpoint}: Address already in use "
        "(another kvstore on this port?)"
    ]


def test_default_endpoint_is_in_a_private_runtime_dir() -> None:
    xdg = {"XDG_RUNTIME_DIR": "/run/user/1000"}
    assert runtime_dir(xdg, uid=1000) == "/run/user/1000/pagedserve"
    assert default_endpoint(xdg, 1000) == "ipc:///run/user/1000/pagedserve/kvstore.sock"
    for env in ({}, {"XDG_RUNTIME_DIR": ""}, {"XDG_RUNTIME_DIR": "relative/dir"}):
        assert (
            default_endpoint(env, 1234, "/var/tmp") == "ipc:///var/tmp/pagedserve-1234/kvstore.sock"
        )
    assert default_endpoint() == DEFAULT_ENDPOINT


def test_an_existing_runtime_dir_open_to_others_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "pagedserve"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    env = env_without_token(XDG_RUNTIME_DIR=str(tmp_path))
    endpoint = default_endpoint({"XDG_RUNTIME_DIR": str(tmp_path)})
    lines = run_refused(kvstore_cmd(endpoint), env)
    assert lines == [
        f"pagedserve kvstore: {shared} must be owned by uid {os.getuid()} with mode 0700; "
        f"it is owned by uid {os.getuid()} with mode 0755: fix or remove it"
    ]
    assert list(shared.iterdir()) == []


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_ipc_socket_lifecycle_and_stale_pool_files(tmp_path: Path) -> None:
    """A private directory and socket; a second daemon refused while the first serves; after a
    SIGKILL, the next daemon replaces the stale socket and removes the dead pool files."""
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    env = env_without_token(XDG_RUNTIME_DIR=str(xdg))
    endpoint = default_endpoint({"XDG_RUNTIME_DIR": str(xdg)})
    sock_path = Path(endpoint.removeprefix("ipc://"))
    first = spawn(endpoint, env)
    fakes: list[Path] = []
    try:
        assert stat.S_IMODE(sock_path.parent.stat().st_mode) == 0o700
        assert stat.S_ISSOCK(sock_path.stat().st_mode)
        assert stat.S_IMODE(sock_path.stat().st_mode) == 0o600
        with KVClient(endpoint, timeout_s=10) as client:
            pool = Path(client.call(p.Register("w-ipc")).pool.shm_path)
        assert pool.name.startswith(f"pagedserve-kv-{first.pid}-")
        assert stat.S_IMODE(pool.stat().st_mode) == 0o600

        lines = run_refused(kvstore_cmd(endpoint), env)
        assert lines == [
            f"pagedserve kvstore: another kvstore is serving at {endpoint}; "
            "stop it or use another --endpoint"
        ]
        with KVClient(endpoint, timeout_s=10) as client:  # the first one still serves
            assert [w.worker_id for w in client.call(p.GetStats()).workers] == ["w-ipc"]

        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert sock_path.exists()  # a SIGKILL leaves the socket file (and the pool file)
        dead = Path(f"/dev/shm/pagedserve-kv-{dead_pid()}-test{os.getpid()}")
        live = Path(f"/dev/shm/pagedserve-kv-{os.getpid()}-test{os.getpid()}")
        fakes += [dead, live]
        for fake in fakes:
            fake.write_bytes(b"x" * 8192)

        second = spawn(endpoint, env)
        try:
            with KVClient(endpoint, timeout_s=10) as client:
                assert client.call(p.GetStats()).workers == []  # a new daemon, not the first
            assert not pool.exists() and not dead.exists() and live.exists()
        finally:
            log = stop_process(second)
        assert "replaced a stale socket file" in log
        # Any kvstore starting meanwhile (another test run on this host) may have removed them
        # first; when this one did, it says how many.
        removed = re.search(r"removed (\d+) stale pool file\(s\) of dead kvstores", log)
        assert removed is None or int(removed[1]) >= 1, log
        assert not sock_path.exists()  # a clean stop removes it
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        for fake in fakes:
            fake.unlink(missing_ok=True)
