"""A worker's leases kept while its loop is busy: ``Heartbeat``, a thread of its own.

Two failure detectors decide that a worker died: the kvstore's lease (renewed by any message of
the worker; ``--lease-timeout-s``) and its claims on its requests in Redis (renewed by
``queue_worker.touch``; another worker takes over a claim idle ``--claim-idle-ms``). The loop
renews both as it steps, but one step can outlast them: a long prompt chunk on a CPU, a CUDA
graph capture, a Triton compile. A worker declared dead mid-step loses its requests, registers
again, takes them back and runs the same long step again, for ever. So a thread renews both
every ``interval_s`` while the loop makes progress (``beat``, once per step); it sends a
``Heartbeat`` on a kvstore socket of its own and touches the entries the loop last said it
holds. A loop silent for ``stall_s`` is hung, not busy: the thread stops renewing, and the
worker is declared dead as if it had died.

The thread only renews: it never changes what the loop owns. ``beat`` replaces one immutable
tuple (the entries held); the thread reads it.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from contracts import queue_keys, queue_worker
from kvstore import protocol as p
from kvstore.client import KVClient, KVStoreError, KVStoreTimeout

__all__ = ["STALL_S", "Heartbeat"]

log = logging.getLogger("pagedserve.compute")
STALL_S = 300.0  # a loop silent this long is hung: its leases are let go


class Heartbeat:
    def __init__(
        self,
        endpoint: str,
        r: redis.Redis,
        worker_id: str,
        interval_s: float,
        stall_s: float = STALL_S,
        stream: str = queue_keys.REQUEST_STREAM,
    ) -> None:
        self._endpoint, self._redis, self._worker_id = endpoint, r, worker_id
        self._stream = stream  # where the worker's requests are pending
        self._interval_s, self._stall_s = interval_s, stall_s
        self._progress = time.monotonic()
        self._held: tuple[str, ...] = ()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.sent = 0  # heartbeats sent, a counter

    def start(self) -> None:
        self._thread.start()

    def beat(self, held: tuple[str, ...]) -> None:
        """The loop made progress and holds the request entries ``held``."""
        self._progress = time.monotonic()
        self._held = held

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def _run(self) -> None:
        with KVClient(self._endpoint, timeout_s=self._interval_s) as kv:
            stalled = False
            while not self._stop.wait(self._interval_s):
                silent = time.monotonic() - self._progress
                if silent > self._stall_s:
                    if not stalled:
                        log.error("the worker's loop made no progress in %.0f s: it is hung; "
                                  "letting its leases go", silent)  # fmt: skip
                    stalled = True
                    continue
                stalled = False
                self._renew(kv)

    def _renew(self, kv: KVClient) -> None:
        try:
            kv.call(p.Heartbeat(self._worker_id))
            self.sent += 1
        except (KVStoreTimeout, KVStoreError) as err:  # the loop notices it, and rebuilds
            log.debug("heartbeat not answered: %s", err)
        held = self._held
        if held:
            try:
                queue_worker.touch(self._redis, self._worker_id, list(held), self._stream)
            except redis.RedisError as err:
                log.debug("claims not renewed: %s", err)
