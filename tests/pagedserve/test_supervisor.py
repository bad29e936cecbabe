"""``pagedserve.supervisor`` over real child processes (small Python programs, and a real
kvstore daemon): restarts with backoff, giving up, starting over after a healthy run, stop
order, a second signal, children that do not outlive the supervisor."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from pagedserve.supervisor import (
    ChildSpec,
    RestartPolicy,
    StartupError,
    Supervisor,
    child_popen_options,
)
from tests.conftest import ROOT

# argv: name, event log, mode, seconds. Notes "start" at startup. mode "exit": exits with code 3
# after `seconds`; "serve": on SIGINT/SIGTERM waits `seconds` and exits 0; "drain": the same, but
# only on the second signal; "stubborn": never exits on a signal.
CHILD = r"""
import os, signal, sys, time
name, log, mode, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
def note(event):
    with open(log, "a") as f:
        f.write(f"{time.monotonic()} {name} {event} {os.getpid()}\n")
note("start")
if mode == "exit":
    time.sleep(seconds)
    sys.exit(3)
received = []
def on_signal(signum, frame):
    received.append(signum)
    note(f"signal{len(received)}")
    if mode == "stubborn" or (mode == "drain" and len(received) < 2):
        return
    time.sleep(seconds)
    note("stop")
    sys.exit(0)
signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
while True:
    time.sleep(0.02)
"""


def child(name: str, log: Path, mode: str, seconds: float = 0.0) -> Callable[[], subprocess.Popen]:
    cmd = [sys.executable, "-c", CHILD, name, str(log), mode, str(seconds)]
    return partial(subprocess.Popen, cmd, **child_popen_options())


def events(log: Path, name: str | None = None, event: str | None = None) -> list[float]:
    """Times of ``name``'s ``event`` lines (every name/event if None)."""
    if not log.exists():
        return []
    rows = [line.split() for line in log.read_text().splitlines()]
    return [float(t) for t, n, e, _ in rows if (name is None or n == name) and event in (None, e)]


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.fixture
def supervisors() -> Iterator[list[Supervisor]]:
    """Supervisors made by a test; whatever they still run is stopped at the end."""
    made: list[Supervisor] = []
    yield made
    for supervisor in made:
        supervisor.stop()


def test_a_crash_looping_child_is_restarted_with_backoff_then_the_supervisor_gives_up(
    tmp_path: Path, supervisors: list[Supervisor], caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "events"
    policy = RestartPolicy(backoff_s=0.4, healthy_after_s=30.0, max_restarts=3)
    supervisor = Supervisor(policy, poll_s=0.05)
    supervisors.append(supervisor)
    supervisor.start(ChildSpec("crasher", child("crasher", log, "exit", 0.2)))
    supervisor.start(ChildSpec("server", child("server", log, "serve"), stop_order=1))
    caplog.set_level(logging.INFO, "pagedserve.supervisor")
    started = time.monotonic()
    assert supervisor.run() == 1
    assert time.monotonic() - started < 20
    starts = events(log, "crasher", "start")
    assert len(starts) == 1 + 3, starts  # the first run, then max_restarts restarts
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    for gap, delay in zip(gaps, [0.4, 0.8, 1.6], strict=True):
        # it ran 0.2 s, then waited `delay`; the upper bound is loose (a slow, shared machine)
        assert 0.2 + delay <= gap < 0.2 + delay + 3.0, (gap, delay)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w.split("restarting in ")[1].split(" s")[0] for w in warnings] == ["0.4", "0.8", "1.6"]
    assert all("exited with exit code 3 after" in w and "crasher (pid " in w for w in warnings)
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert error.startswith("giving up: crasher (pid "), error
    assert "exit code 3" in error and "4 failures in a row (at most 3 restarts)" in error
    # the other child was stopped (asked, not killed) before run returned
    assert events(log, "server", "signal1") and events(log, "server", "stop")


def test_a_child_that_stays_up_long_enough_starts_over(
    tmp_path: Path, supervisors: list[Supervisor], caplog: pytest.LogCaptureFixture
) -> None:
    """It runs 1 s, longer than healthy_after_s: each failure is its first in a row, so with
    max_restarts=1 it is restarted again and again, always after backoff_s."""
    log = tmp_path / "events"
    policy = RestartPolicy(backoff_s=0.2, healthy_after_s=0.6, max_restarts=1)
    supervisor = Supervisor(policy, poll_s=0.05)
    supervisors.append(supervisor)
    supervisor.start(ChildSpec("flaky", child("flaky", log, "exit", 1.0)))
    caplog.set_level(logging.INFO, "pagedserve.supervisor")
    threading.Timer(5.0, supervisor.request_stop).start()
    assert supervisor.run() == 0  # stopped by the "signal", never gave up
    assert len(events(log, "flaky", "start")) >= 3
    messages = [r.getMessage() for r in caplog.records]
    restarts = [m for m in messages if "restarting in" in m]
    assert len(restarts) >= 2 and all("restarting in 0.2 s (restart 1 of" in m for m in restarts)
    assert any("failure count and backoff reset" in m for m in messages), messages


def test_stop_order_a_second_signal_and_a_child_that_will_not_stop(
    tmp_path: Path, supervisors: list[Supervisor], caplog: pytest.LogCaptureFixture
) -> None:
    """gateway (order 0), then worker (1; drains until a second signal), then kvstore (2), then
    redis (3; ignores signals: killed after its stop timeout)."""
    log = tmp_path / "events"
    supervisor = Supervisor(RestartPolicy(), poll_s=0.05)
    supervisors.append(supervisor)
    specs = [
        ChildSpec("redis", child("redis", log, "stubborn"), stop_order=3, stop_timeout_s=1.0),
        ChildSpec("worker", child("worker", log, "drain", 0.1), stop_order=1),
        ChildSpec("gateway", child("gateway", log, "serve", 0.3), stop_order=0),
        ChildSpec("kvstore", child("kvstore", log, "serve", 0.2), stop_order=2),
    ]
    pids = {spec.name: supervisor.start(spec).pid for spec in specs}
    caplog.set_level(logging.INFO, "pagedserve.supervisor")

    def operator() -> None:  # Ctrl-C, then Ctrl-C again once the worker drains
        time.sleep(1.0)
        supervisor.request_stop(signal.SIGINT)
        deadline = time.monotonic() + 20
        while not events(log, "worker", "signal1") and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # the worker keeps draining: nothing happens until the second signal
        assert not events(log, "worker", "stop")
        supervisor.request_stop(signal.SIGINT)

    thread = threading.Thread(target=operator)
    thread.start()
    assert supervisor.run() == 0
    thread.join()
    [gateway_stop] = events(log, "gateway", "stop")
    [worker_signal] = events(log, "worker", "signal1")
    [worker_stop] = events(log, "worker", "stop")
    [kvstore_signal] = events(log, "kvstore", "signal1")
    [kvstore_stop] = events(log, "kvstore", "stop")
    [redis_signal] = events(log, "redis", "signal1")
    assert gateway_stop < worker_signal < worker_stop < kvstore_signal < kvstore_stop
    assert kvstore_stop < redis_signal
    assert events(log, "worker", "signal2")  # the second Ctrl-C reached the draining worker
    assert not events(log, "redis", "stop")
    assert any("redis did not stop within 1 s: killed" in r.getMessage() for r in caplog.records)
    assert not any(alive(pid) for pid in pids.values())
    supervisor.stop()  # idempotent


def test_a_second_signal_before_the_workers_stop_makes_them_stop_at_once(
    tmp_path: Path, supervisors: list[Supervisor]
) -> None:
    """Ctrl-C twice while the gateway still finishes its requests: the workers, stopped next,
    get their stop signal twice (0.5 s apart, so that the two do not merge into one)."""
    log = tmp_path / "events"
    supervisor = Supervisor(RestartPolicy(), poll_s=0.05)
    supervisors.append(supervisor)
    supervisor.start(ChildSpec("gateway", child("gateway", log, "serve", 1.0), stop_order=0))
    supervisor.start(ChildSpec("worker", child("worker", log, "drain"), stop_order=1))
    threading.Timer(0.5, supervisor.request_stop).start()
    threading.Timer(0.8, supervisor.request_stop).start()
    started = time.monotonic()
    assert supervisor.run() == 0
    assert time.monotonic() - started < 10
    assert events(log, "worker", "signal2") and events(log, "worker", "stop")


def test_startup_failure_and_a_child_that_cannot_be_started_again(
    tmp_path: Path, supervisors: list[Supervisor], caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "events"
    supervisor = Supervisor(RestartPolicy(backoff_s=0.05, max_restarts=2), poll_s=0.05)
    supervisors.append(supervisor)
    supervisor.start(ChildSpec("early", child("early", log, "exit", 0.2)))
    with pytest.raises(StartupError, match=r"early exited during startup \(exit code 3\)"):
        supervisor.wait_until(lambda: "still waiting", 30, "something")
    supervisor.stop()

    calls = []

    def start_once() -> subprocess.Popen:
        calls.append(time.monotonic())
        if len(calls) > 1:
            raise FileNotFoundError(2, "No such file or directory", "/gone/binary")
        return child("once", log, "exit", 0.1)()

    supervisor = Supervisor(RestartPolicy(backoff_s=0.05, max_restarts=2), poll_s=0.05)
    supervisors.append(supervisor)
    supervisor.start(ChildSpec("once", start_once))
    caplog.set_level(logging.INFO, "pagedserve.supervisor")
    assert supervisor.run() == 1
    assert len(calls) == 3  # the start, then two attempts to restart it
    messages = [r.getMessage() for r in caplog.records]
    assert sum("could not be started" in m and "/gone/binary" in m for m in messages) == 2
    assert messages[-1].startswith("giving up: once could not be started"), messages


def test_children_do_not_outlive_a_killed_supervisor(tmp_path: Path) -> None:
    """SIGKILL the supervisor's process: the kernel sends its children SIGTERM
    (PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    program = """
import sys
from functools import partial
import subprocess
from pagedserve.supervisor import ChildSpec, RestartPolicy, Supervisor, child_popen_options
start = partial(subprocess.Popen, [sys.executable, "-c", "import time; time.sleep(600)"],
                **child_popen_options())
supervisor = Supervisor(RestartPolicy())
print(supervisor.start(ChildSpec("sleeper", start)).pid, flush=True)
supervisor.run()
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen(
        [sys.executable, "-c", program], stdout=subprocess.PIPE, text=True, env=env
    )
    pid = 0
    try:
        pid = int(parent.stdout.readline())  # type: ignore[union-attr]
        assert alive(pid)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while alive(pid):
            assert time.monotonic() < deadline, "the child outlived its supervisor"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_kvstore_daemon_is_restarted(supervisors: list[Supervisor]) -> None:
    """A real `pagedserve kvstore` under the supervisor: SIGKILLed, it is started again on the
    same endpoint and answers a ping (what `pagedserve up` does; workers are not involved)."""
    from pagedserve.probe import ProbeFailed, probe_kvstore
    from pagedserve.procs import spawn_process

    endpoint = f"ipc:///tmp/pagedserve-sup-{uuid.uuid4().hex[:8]}.sock"
    flags = ["--endpoint", endpoint, "--model", "tiny", "--device", "cpu", "--kv-memory", "0.01GiB"]
    start = partial(
        spawn_process,
        "kvstore",
        flags,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        **child_popen_options(),
    )
    supervisor = Supervisor(RestartPolicy(backoff_s=0.2, max_restarts=2), poll_s=0.05)
    supervisors.append(supervisor)

    def ping() -> str | None:
        try:
            probe_kvstore(endpoint, 1.0)
        except ProbeFailed as err:
            return str(err)
        return None

    first = supervisor.start(ChildSpec("kvstore", start))
    supervisor.wait_until(ping, 60, "the kvstore")
    first.kill()
    first.wait()

    def stop_once_restarted() -> None:  # an on_tick hook: runs in run()'s loop
        if supervisor.pid("kvstore") not in (None, first.pid) and ping() is None:
            supervisor.request_stop()

    supervisor.on_tick.append(stop_once_restarted)
    threading.Timer(60, supervisor.request_stop).start()  # in case it never comes back
    started = time.monotonic()
    assert supervisor.run() == 0
    assert time.monotonic() - started < 60, "the kvstore did not come back"
    assert supervisor.pid("kvstore") != first.pid
    assert not os.path.exists(endpoint.removeprefix("ipc://"))  # stopped cleanly by run()
