"""Starting the stack's processes as children and waiting for them: `pagedserve <command>` in a
child interpreter (``spawn_process``), the kvstore until it answers (``spawn_kvstore``), the
workers until they registered (``wait_for_workers``). Used by ``pagedserve up``, ``pagedserve
convert``, the benches and the tests; it imports no other module of ``pagedserve``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, overload


def spawn_kvstore(
    endpoint: str, flags: list[str], timeout_s: float = 120.0, **popen: Any
) -> subprocess.Popen[bytes]:
    """Starts `pagedserve kvstore` as a child process and returns once it answers a ping."""
    process = spawn_process("kvstore", ["--endpoint", endpoint, *flags], **popen)
    try:
        wait_for_kvstore(endpoint, process, timeout_s)
    except BaseException:
        process.kill()
        raise
    return process


def wait_for_kvstore(endpoint: str, process: subprocess.Popen[Any], timeout_s: float) -> None:
    """Until the kvstore at ``endpoint`` answers a ping; exits if ``process`` (it) exits."""
    from kvstore import protocol as p
    from kvstore.client import KVClient, KVStoreTimeout

    client = KVClient(endpoint, timeout_s=1.0)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"kvstore exited with {process.returncode}")
            try:
                client.call(p.Ping())
                return
            except KVStoreTimeout:
                continue
        raise SystemExit(f"kvstore not healthy after {timeout_s} s")
    finally:
        client.close()


@overload
def spawn_process(
    command: str, flags: list[str], *, text: Literal[True], **popen: Any
) -> subprocess.Popen[str]: ...
@overload
def spawn_process(
    command: str, flags: list[str], *, text: Literal[False] = False, **popen: Any
) -> subprocess.Popen[bytes]: ...
def spawn_process(command: str, flags: list[str], **popen: Any) -> subprocess.Popen[Any]:
    """`pagedserve <command> <flags>` as a child process, this checkout on its PYTHONPATH
    (``env``, if given, replaces ``os.environ`` otherwise); ``popen``: ``subprocess.Popen``'s
    keywords (``text=True``: its pipes carry ``str``)."""
    root = str(Path(__file__).resolve().parent.parent)
    base = popen.pop("env", None) or os.environ
    env = {**base, "PYTHONPATH": os.pathsep.join([root, base.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pagedserve.cli", command, *flags]
    return subprocess.Popen(cmd, env=env, **popen)


def wait_for_workers(
    endpoint: str, count: int, processes: Sequence[subprocess.Popen[Any]], timeout_s: float
) -> None:
    """Until ``count`` workers are registered at the kvstore (they load and profile first)."""
    from kvstore import protocol as p
    from kvstore.client import KVClient

    deadline = time.monotonic() + timeout_s
    with KVClient(endpoint, timeout_s=5) as client:
        while time.monotonic() < deadline:
            if any(process.poll() is not None for process in processes):
                raise SystemExit("a process exited during startup")
            stats = client.call(p.GetStats(0))
            if len(stats.workers) >= count:
                return
            time.sleep(0.5)
    raise SystemExit(f"{count} workers not registered after {timeout_s} s")


def interrupt(process: subprocess.Popen[Any], grace_s: float = 120) -> None:
    """Stops ``process`` as Ctrl-C would (SIGINT), then SIGKILL after ``grace_s``."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
