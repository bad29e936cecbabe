"""A synchronous client of the kvstore daemon (ZeroMQ DEALER). Torch-free."""

from __future__ import annotations

import itertools
import time
from typing import overload

import zmq

from contracts.endpoints import env_token
from kvstore import protocol as p


class KVStoreError(Exception):
    """The daemon answered with an ``Error`` reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class KVStoreTimeout(Exception):
    """No reply within the timeout (the daemon is down or overloaded)."""


def expect_reply(body: p.Request, reply: p.ReplyBody) -> p.ReplyBody:
    """``reply`` if it is what ``body`` gets on success; else raises ``KVStoreError``."""
    if isinstance(reply, p.Error):
        raise KVStoreError(reply.code, reply.message)
    expected = p.REPLY_OF[type(body)]
    if not isinstance(reply, expected):
        message = f"{type(body).__name__} answered with {type(reply).__name__}"
        raise KVStoreError("bad_reply", message)
    return reply


class KVClient:
    """Calls may overlap: ``send`` one, make others, then ``receive`` it (the daemon answers in
    order; a reply that arrives while another is awaited is kept for its own ``receive``).
    Replies to calls that timed out or were ``forget``-ten are skipped by id."""

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
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._unanswered: set[int] = set()  # sent, their reply not taken yet
        self._kept: dict[int, p.Reply] = {}  # replies that came while another was awaited

    @overload
    def call(self, body: p.Register) -> p.Registered: ...
    @overload
    def call(self, body: p.Heartbeat | p.Unregister) -> p.Ack: ...
    @overload
    def call(self, body: p.Step) -> p.StepReply: ...
    @overload
    def call(self, body: p.GetStats) -> p.Stats: ...
    @overload
    def call(self, body: p.ResetCache) -> p.CacheReset: ...
    @overload
    def call(self, body: p.Ping) -> p.Pong: ...
    @overload
    def call(self, body: p.GetBlockMap) -> p.BlockMap: ...
    @overload
    def call(self, body: p.GetBlockInfo) -> p.BlockInfo: ...
    def call(self, body: p.Request) -> p.ReplyBody:
        """Sends ``body`` and returns its reply (``p.REPLY_OF``); raises ``KVStoreError`` on an
        Error reply or a reply of another kind, ``KVStoreTimeout`` without one in time."""
        return self.receive(body, self.send(body))

    def send(self, body: p.Request) -> int:
        """Sends ``body`` without waiting; returns the call id to pass to ``receive`` (or to
        ``forget``). The caller may do other work and make other calls meanwhile."""
        call_id = next(self._ids)
        self._sock.send(p.encode(p.Call(p.PROTOCOL_VERSION, call_id, body, self._token)))
        self._unanswered.add(call_id)
        return call_id

    def receive(self, body: p.Request, call_id: int) -> p.ReplyBody:
        """The reply to ``send(body)`` (as ``call``)."""
        return expect_reply(body, self._reply(call_id).body)

    def forget(self, call_id: int) -> None:
        """The reply to ``call_id`` will not be received: it is skipped when it comes."""
        self._unanswered.discard(call_id)
        self._kept.pop(call_id, None)

    def call_raw(self, *frames: bytes, call_id: int | None = None) -> p.Reply:
        """Sends raw frames and waits for the reply to ``call_id`` (None: the next reply; tests
        send garbage this way)."""
        self._sock.send_multipart(list(frames))
        return self._reply(call_id)

    def _reply(self, call_id: int | None) -> p.Reply:
        """The reply to ``call_id`` (None: the next one), or to no call (id 0: an error about
        the frame itself). Replies to other unanswered calls are kept; others are skipped."""
        if call_id in self._kept:
            self._unanswered.discard(call_id)
            return self._kept.pop(call_id)
        try:
            while True:
                reply = p.decode_reply(self._receive())
                if call_id is None or reply.call_id in (call_id, 0):
                    return reply
                if reply.call_id in self._unanswered:
                    self._kept[reply.call_id] = reply
        finally:
            if call_id is not None:
                self._unanswered.discard(call_id)  # answered, or given up after a timeout

    def _receive(self) -> bytes:
        spin_until = time.perf_counter() + self.spin_s
        while time.perf_counter() < spin_until:
            try:
                frame: bytes = self._sock.recv(zmq.NOBLOCK)
                return frame
            except zmq.Again:
                continue
        if not self._sock.poll(self.timeout_ms):
            raise KVStoreTimeout(f"no reply from {self.endpoint} in {self.timeout_ms} ms")
        frame = self._sock.recv()
        return frame

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
