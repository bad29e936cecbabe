"""A synchronous client of the kvstore daemon (ZeroMQ DEALER). Torch-free."""

from __future__ import annotations

import itertools
import time

import zmq

from kvstore import protocol as p
from kvstore.security import env_token


class KVStoreError(Exception):
    """The daemon answered with an ``Error`` reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class KVStoreTimeout(Exception):
    """No reply within the timeout (the daemon is down or overloaded)."""


class KVClient:
    """One outstanding call at a time. Replies to earlier, timed-out calls are skipped by id."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = 10.0,
        spin_s: float = 0.0,
        token: str | None = None,
    ) -> None:
        """``spin_s``: how long to busy-wait for a reply before sleeping in ``poll`` (a sleeping
        process pays a scheduler wake-up, tens of µs on a VM; a worker's step is worth a core).
        ``token``: sent with every call; None reads ``$PAGEDSERVE_KVSTORE_TOKEN`` (unset: "")."""
        self.endpoint = endpoint
        self._token = env_token() if token is None else token
        self.timeout_ms = int(timeout_s * 1000)
        self.spin_s = spin_s
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)

    def call(self, body: p.Request) -> p.ReplyBody:
        """Sends ``body`` and returns the reply body; raises ``KVStoreError`` on an Error reply."""
        call_id = next(self._ids)
        frame = p.encode(p.Call(p.PROTOCOL_VERSION, call_id, body, self._token))
        reply = self.call_raw(frame, call_id=call_id)
        if isinstance(reply.body, p.Error):
            raise KVStoreError(reply.body.code, reply.body.message)
        return reply.body

    def call_raw(self, *frames: bytes, call_id: int | None = None) -> p.Reply:
        """Sends raw frames and waits for the reply to ``call_id`` (None: the next reply; tests
        send garbage this way). Replies to earlier, timed-out calls are skipped."""
        self._sock.send_multipart(list(frames))
        while True:
            reply = p.decode_reply(self._receive())
            if call_id is None or reply.call_id in (call_id, 0):
                return reply

    def _receive(self) -> bytes:
        spin_until = time.perf_counter() + self.spin_s
        while time.perf_counter() < spin_until:
            try:
                return self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                continue
        if not self._sock.poll(self.timeout_ms):
            raise KVStoreTimeout(f"no reply from {self.endpoint} in {self.timeout_ms} ms")
        return self._sock.recv()

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
