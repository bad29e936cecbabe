"""Several `pagedserve up` on one host, started without --endpoint or --redis-dir: each stack's
kvstore socket and Redis directory are named after its gateway port, so two stacks on two ports
both serve and stopping one leaves the other serving; a genuine clash is one line."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from contracts.endpoints import STACK_ENDPOINT, for_port
from pagedserve.redis_server import free_port
from tests.pagedserve.test_up import stream_one_completion, up_env
from tests.pagedserve.test_up_supervised import wait_for


def up_without_flags(port: int, *flags: str) -> list[str]:
    """`pagedserve up` of the tiny model on CPU at ``port``: no --endpoint, no --redis-dir."""
    return [
        sys.executable,
        "-m",
        "pagedserve.cli",
        "up",
        "--device",
        "cpu",
        "--port",
        str(port),
        "--kvstore-args",
        "--kv-memory 0.05GiB --swap-memory 0.01",
        *flags,
    ]


def start(port: int, cwd: Path) -> tuple[subprocess.Popen[bytes], Path]:
    log_path = cwd / f"up-{port}.log"
    with log_path.open("wb") as log_file:
        up = subprocess.Popen(
            up_without_flags(port),
            cwd=cwd,
            env=up_env(),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    return up, log_path


def example(log_path: Path) -> str:
    """The curl example of the banner."""
    text = log_path.read_text()
    return text[text.index("pagedserve is up") :].splitlines()[2].removeprefix("try: ")


def stop(up: subprocess.Popen[bytes], log_path: Path) -> None:
    up.send_signal(signal.SIGINT)
    try:
        assert up.wait(120) == 0, log_path.read_text()
    except subprocess.TimeoutExpired:
        up.kill()
        up.wait()
        raise


def test_two_stacks_on_two_ports_need_no_flags_and_stop_alone(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    while ports[1] == ports[0]:
        ports[1] = free_port()
    stacks = [start(port, tmp_path) for port in ports]
    try:
        for (up, log_path), port in zip(stacks, ports, strict=True):
            wait_for(
                f"the banner of port {port}", lambda p=log_path: "ids (" in p.read_text(), 240, up
            )
            banner = log_path.read_text().split("pagedserve is up")[1].splitlines()[0]
            assert f"kvstore {for_port(STACK_ENDPOINT, port)}," in banner, banner
            assert (tmp_path / f".pagedserve/redis-{port}/port").exists()
        # Both serve, each with its own kvstore and Redis.
        for _, log_path in stacks:
            assert len(stream_one_completion(example(log_path))) > 0
        # A genuine clash is one line, before anything starts: the same port again, or the same
        # kvstore endpoint on another port.
        clash = subprocess.run(
            up_without_flags(ports[0]), cwd=tmp_path, env=up_env(), capture_output=True, text=True
        )
        assert clash.returncode == 1
        assert (
            clash.stderr == f"pagedserve up: port {ports[0]} on 127.0.0.1 is in use; pass --port\n"
        )
        endpoint = for_port(STACK_ENDPOINT, ports[0])
        clash = subprocess.run(
            up_without_flags(free_port(), "--endpoint", endpoint),
            cwd=tmp_path,
            env=up_env(),
            capture_output=True,
            text=True,
        )
        assert clash.returncode == 1
        assert clash.stderr == (
            f"pagedserve up: another kvstore is serving at {endpoint}; stop it or pass another "
            "--endpoint\n"
        )
        # Stopping the first leaves the second serving.
        stop(*stacks[0])
        assert not Path(endpoint.removeprefix("ipc://")).exists()
        assert stacks[1][0].poll() is None
        assert len(stream_one_completion(example(stacks[1][1]))) > 0
        stop(*stacks[1])
    finally:
        for up, _ in stacks:
            if up.poll() is None:
                up.kill()
                up.wait()
    for _, log_path in stacks:
        assert "Traceback" not in log_path.read_text(), log_path.read_text()
