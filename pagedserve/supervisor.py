"""A small process supervisor: what `pagedserve up` runs its children under.

Each child is a ``ChildSpec``: a name, how to start it (called again for every restart), the
signal that asks it to stop and its place in the stop order. ``Supervisor.start`` launches a
child, ``wait_until`` waits for a readiness probe during startup (any exit then is fatal), and
``run`` watches them: a child that exits is restarted after an exponential backoff, until one
fails too often in a row; then, or on SIGINT/SIGTERM, every child is stopped in order.

Who stops what: only ``Supervisor.stop`` (called by ``run`` on its way out) stops children,
group by group in ascending ``stop_order``; a group's children get their stop signal together,
every further SIGINT/SIGTERM that reaches the supervisor meanwhile sends them their stop signal
again (a second Ctrl-C makes a draining worker stop at once), and what is still running after
``stop_timeout_s`` is killed. Children run in their own session (a terminal's Ctrl-C reaches
only the supervisor) and, on Linux, get SIGTERM from the kernel when the supervisor dies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

log = logging.getLogger("pagedserve.supervisor")

_PR_SET_PDEATHSIG = 1
# Looked up once, here: after a fork in a process with threads (zmq's), the child must not
# take the dynamic loader's lock.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(parent: int) -> None:
    """In a child before exec (``preexec_fn``, with the parent's pid bound): the child gets
    SIGTERM when the thread that started it exits (Linux ``PR_SET_PDEATHSIG``; a no-op
    elsewhere). Start children from a thread that outlives them (the main thread)."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl: nobody would signal us
        os.kill(os.getpid(), signal.SIGTERM)


def child_popen_options() -> dict[str, Any]:
    """``Popen`` keywords for a supervised child: its own session, and dead with its parent."""
    return {"start_new_session": True, "preexec_fn": partial(die_with_parent, os.getpid())}


def describe_exit(returncode: int) -> str:
    """``exit code 3`` or ``signal SIGKILL``."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


@dataclass(frozen=True)
class ChildSpec:
    """One supervised child. ``start`` launches a new process (first start and every restart,
    with the same arguments and environment). ``stop_order``: children stop in ascending order,
    those with equal order together. ``stop_signal`` asks the child to stop; past
    ``stop_timeout_s`` it is killed."""

    name: str
    start: Callable[[], subprocess.Popen[Any]]
    stop_order: int = 0
    stop_signal: int = signal.SIGINT
    stop_timeout_s: float = 120.0


@dataclass(frozen=True)
class RestartPolicy:
    """A child that exits (with any status: nobody asked it to) is restarted after
    ``backoff_s``, doubled for each further failure in a row, at most ``max_backoff_s``. A
    child that stayed up ``healthy_after_s`` starts over: no failures, ``backoff_s``. A child
    that fails again after ``max_restarts`` restarts in a row makes the supervisor give up
    (0: never restart)."""

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    healthy_after_s: float = 60.0
    max_restarts: int = 5

    def __post_init__(self) -> None:
        if self.backoff_s <= 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"restart backoff must be > 0 and <= {self.max_backoff_s:g} s")
        if self.healthy_after_s < 0 or self.max_restarts < 0:
            raise ValueError("healthy-after and max-restarts must be >= 0")

    def delay(self, failures: int) -> float:
        """The wait before the restart that follows the ``failures``-th failure in a row."""
        return min(self.backoff_s * 2.0 ** max(failures - 1, 0), self.max_backoff_s)


class StartupError(Exception):
    """A child exited, or a probe did not succeed in time, before the stack was up."""


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived during startup."""


@dataclass
class _Child:
    spec: ChildSpec
    process: subprocess.Popen[Any] | None = None
    started_at: float = 0.0
    failures: int = 0  # in a row, each within healthy_after_s of its start
    restart_at: float = 0.0  # when process is None: when to start it again


class Supervisor:
    """Runs children (see the module docstring). Call it from the main thread: children die
    with the thread that started them (``die_with_parent``)."""

    def __init__(
        self,
        policy: RestartPolicy,
        *,
        poll_s: float = 0.2,
        on_tick: Sequence[Callable[[], None]] = (),
    ) -> None:
        """``on_tick``: called every ``poll_s`` while ``run`` watches (e.g. an external Redis
        check); they must return quickly."""
        self.policy = policy
        self.poll_s = poll_s
        self.on_tick = list(on_tick)
        self.signals: list[int] = []  # SIGINT/SIGTERM received, appended by the handler
        self._children: list[_Child] = []
        self._stopped = False

    def install_signal_handlers(self) -> None:
        """SIGINT and SIGTERM only record themselves: ``wait_until`` and ``run`` return on the
        first, ``stop`` passes each later one on to the children it is stopping."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda received, _frame: self.signals.append(received))

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """As if ``signum`` had arrived."""
        self.signals.append(signum)

    def start(self, spec: ChildSpec) -> subprocess.Popen[Any]:
        """Starts ``spec`` now and supervises it from then on."""
        process = spec.start()
        self._children.append(_Child(spec, process, time.monotonic()))
        return process

    def pid(self, name: str) -> int | None:
        """The running pid of child ``name`` (None while it waits to be restarted)."""
        for child in self._children:
            if child.spec.name == name and child.process is not None:
                return child.process.pid
        return None

    def wait_until(self, probe: Callable[[], str | None], timeout_s: float, what: str) -> None:
        """Startup: calls ``probe`` (None once ready, else what it still waits for) until it is
        ready. Raises ``StartupError`` if a child exits or after ``timeout_s``,
        ``Interrupted`` on SIGINT/SIGTERM."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            if self.signals:
                raise Interrupted
            for child in self._children:
                if child.process is not None and child.process.poll() is not None:
                    how = describe_exit(child.process.returncode)
                    raise StartupError(f"{child.spec.name} exited during startup ({how})")
            waiting = probe()
            if waiting is None:
                return
            last = waiting
            if time.monotonic() >= deadline:
                raise StartupError(f"{what} not ready after {timeout_s:g} s: {last}")
            time.sleep(self.poll_s)

    def run(self) -> int:
        """Watches the children until SIGINT/SIGTERM (returns 0) or until one fails more than
        ``max_restarts`` times in a row (logs why, returns 1); stops them all either way."""
        try:
            while not self.signals:
                for child in self._children:
                    if not self._check(child, time.monotonic()):
                        return 1
                for tick in self.on_tick:
                    tick()
                time.sleep(self.poll_s)
            name = signal.Signals(self.signals[0]).name
            log.info("%s: stopping every child in order (again: passed on to them)", name)
            return 0
        finally:
            self.stop()

    def stop(self) -> None:
        """Stops every child, group by group in ascending ``stop_order``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for order in sorted({child.spec.stop_order for child in self._children}):
            group = [c for c in self._children if c.spec.stop_order == order and c.process]
            self._stop_group(group)

    def _check(self, child: _Child, now: float) -> bool:
        """Restarts ``child`` when due, notes its exit; False: give up."""
        if child.process is None:
            return now < child.restart_at or self._restart(child)
        returncode = child.process.poll()
        uptime = now - child.started_at
        if returncode is None:
            if child.failures and uptime >= self.policy.healthy_after_s:
                log.info(
                    "%s up for %.0f s: failure count and backoff reset", child.spec.name, uptime
                )
                child.failures = 0
            return True
        return self._failed(
            child,
            f"(pid {child.process.pid}) exited with "
            f"{describe_exit(returncode)} after {uptime:.1f} s up",
            uptime,
            now,
        )

    def _failed(self, child: _Child, what: str, uptime: float, now: float) -> bool:
        """Counts a failure of ``child`` and schedules its restart; False: give up."""
        policy = self.policy
        if uptime >= policy.healthy_after_s:
            child.failures = 0
        child.failures += 1
        child.process = None
        if child.failures > policy.max_restarts:
            log.error(
                "giving up: %s %s, %d failures in a row (at most %d restarts); stopping everything",
                child.spec.name,
                what,
                child.failures,
                policy.max_restarts,
            )
            return False
        delay = policy.delay(child.failures)
        log.warning(
            "%s %s; restarting in %.1f s (restart %d of at most %d in a row)",
            child.spec.name,
            what,
            delay,
            child.failures,
            policy.max_restarts,
        )
        child.restart_at = now + delay
        return True

    def _restart(self, child: _Child) -> bool:
        """Starts ``child`` again; False: it could not be, once too often: give up."""
        try:
            child.process = child.spec.start()
        except (OSError, subprocess.SubprocessError) as err:
            return self._failed(child, f"could not be started ({err})", 0.0, time.monotonic())
        child.started_at = time.monotonic()
        log.info("%s restarted (pid %d)", child.spec.name, child.process.pid)
        return True

    def _stop_group(self, group: list[_Child]) -> None:
        """Stop signal to each; each later SIGINT/SIGTERM to the supervisor sends it again (if
        one came already, while earlier groups stopped, it is sent again after 0.5 s: signals
        sent at once would merge into one); SIGKILL past ``stop_timeout_s``."""
        running = [c for c in group if c.process is not None and c.process.poll() is None]
        for child in running:
            _signal(child, child.spec.stop_signal)
        start, seen = time.monotonic(), len(self.signals)
        repeat_at = start + 0.5 if len(self.signals) > 1 else None
        while running := [c for c in running if c.process and c.process.poll() is None]:
            now = time.monotonic()
            if len(self.signals) > seen or (repeat_at is not None and now >= repeat_at):
                seen, repeat_at = len(self.signals), None
                for child in running:
                    _signal(child, child.spec.stop_signal)
            for child in running:
                if now - start >= child.spec.stop_timeout_s and child.process:
                    log.warning(
                        "%s did not stop within %g s: killed",
                        child.spec.name,
                        child.spec.stop_timeout_s,
                    )
                    child.process.kill()
                    child.process.wait()
            time.sleep(0.05)


def _signal(child: _Child, signum: int) -> None:
    if child.process is not None and child.process.poll() is None:
        child.process.send_signal(signum)
