"""A call in flight when its daemon dies fails at once (``KVStoreLost``), not after the client's
timeout; the client then reaches the next daemon on the same endpoint. Real daemon processes."""

from __future__ import annotations

import signal
import time

import pytest

from kvstore import protocol as p
from kvstore.client import KVClient, KVStoreLost, KVStoreTimeout
from tests.conftest import start_kvstore, stop_process

FLAGS = ("--kv-memory", "0.01GiB", "--swap-memory", "0", "--no-calibrate")
TIMEOUT_S = 60.0  # the client's: a loss must be told long before it
BOUND_S = 15.0  # from the kill to the error, on a loaded machine


def test_a_call_in_flight_fails_when_its_daemon_dies_and_the_next_daemon_answers() -> None:
    first, endpoint = start_kvstore(*FLAGS)
    second = third = None
    with KVClient(endpoint, timeout_s=TIMEOUT_S) as client:
        try:
            assert isinstance(client.call(p.Ping()), p.Pong)
            first.send_signal(signal.SIGSTOP)  # it reads nothing more: the next call waits
            call_id = client.send(p.Ping())
            time.sleep(0.2)
            killed_at = time.monotonic()
            first.send_signal(signal.SIGKILL)
            with pytest.raises(KVStoreLost):
                client.receive(p.Ping(), call_id)
            told = time.monotonic() - killed_at
            assert told < BOUND_S, told
            first.wait(10)
            # A call sent while no daemon listens waits for the next one, on the same socket.
            call_id = client.send(p.Ping())
            second, _ = start_kvstore(*FLAGS, endpoint=endpoint)
            assert isinstance(client.receive(p.Ping(), call_id), p.Pong)
            assert isinstance(client.call(p.Ping()), p.Pong)
            # Killed while no call was in flight: the next call fails at once (its daemon is
            # gone, and what it knew of this client); the one after reaches the next daemon.
            second.kill()
            second.wait(10)
            time.sleep(0.5)  # the disconnection reaches the client's monitor
            started = time.monotonic()
            with pytest.raises(KVStoreLost):
                client.call(p.Ping())
            assert time.monotonic() - started < BOUND_S
            call_id = client.send(p.Ping())
            third, _ = start_kvstore(*FLAGS, endpoint=endpoint)
            assert isinstance(client.receive(p.Ping(), call_id), p.Pong)
        finally:
            if first.poll() is None:
                first.kill()
            for later in (second, third):
                if later is not None and later.poll() is None:
                    stop_process(later)
    print(f"the lost call failed {told:.3f} s after the kill (timeout {TIMEOUT_S:g} s)")


def test_without_a_loss_a_silent_daemon_still_times_out() -> None:
    """A daemon that is stopped, not dead, keeps its connection: the timeout applies."""
    daemon, endpoint = start_kvstore(*FLAGS)
    try:
        with KVClient(endpoint, timeout_s=1.0) as client:
            daemon.send_signal(signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises(KVStoreTimeout) as raised:
                client.call(p.Ping())
            assert type(raised.value) is KVStoreTimeout
            assert time.monotonic() - started >= 0.9
            daemon.send_signal(signal.SIGCONT)
    finally:
        daemon.send_signal(signal.SIGCONT)
        stop_process(daemon)
