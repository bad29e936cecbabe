"""A synchronous client of the kvstore daemon (ZeroMQ DEALER). Torch-free.

When the connection closes (the daemon died: its socket closed), the calls unanswered then fail
at once with ``KVStoreLost``, a ``KVStoreTimeout``, rather than after the timeout; if no call
was unanswered, the next one fails so, without being sent: the daemon this client spoke to is
gone, and what it knew of the client with it (a worker registers again). The client watches its
socket's disconnections with a ZeroMQ socket monitor. ZeroMQ reconnects by itself: later calls
wait for the next daemon.
"""

from __future__ import annotations

import itertools
import time
from typing import overload

import zmq
from zmq.utils.monitor import parse_monitor_message

from contracts.endpoints import env_token
from kvstore import protocol as p


class KVStoreError(Exception):
    """The daemon answered with an ``Error`` reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class KVStoreTimeout(Exception):
    """No reply within the timeout (the daemon is down or overloaded)."""


class KVStoreLost(KVStoreTimeout):
    """The connection the call went out on closed before its reply came: none will come."""


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
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._ids = itertools.count(1)
        self._unanswered: set[int] = set()  # sent, their reply not taken yet
        self._lost: set[int] = set()  # unanswered when their connection closed
        self._lose_next = False  # the connection closed while no call was unanswered
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
    @overload
    def call(self, body: p.Route) -> p.Routed: ...
    def call(self, body: p.Request) -> p.ReplyBody:
        """Sends ``body`` and returns its reply (``p.REPLY_OF``); raises ``KVStoreError`` on an
        Error reply or a reply of another kind, ``KVStoreTimeout`` without one in time."""
        return self.receive(body, self.send(body))

    def send(self, body: p.Request) -> int:
        """Sends ``body`` without waiting; returns the call id to pass to ``receive`` (or to
        ``forget``). The caller may do other work and make other calls meanwhile."""
        call_id = next(self._ids)
        if self._monitor_ready():
            self._take_disconnects()
        self._unanswered.add(call_id)
        if self._lose_next:  # its daemon is gone: ``receive`` raises KVStoreLost
            self._lose_next = False
            self._lost.add(call_id)
            return call_id
        self._sock.send(p.encode(p.Call(p.PROTOCOL_VERSION, call_id, body, self._token)))
        return call_id

    def receive(self, body: p.Request, call_id: int) -> p.ReplyBody:
        """The reply to ``send(body)`` (as ``call``)."""
        return expect_reply(body, self._reply(call_id).body)

    def forget(self, call_id: int) -> None:
        """The reply to ``call_id`` will not be received: it is skipped when it comes."""
        self._unanswered.discard(call_id)
        self._lost.discard(call_id)
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
                reply = p.decode_reply(self._receive(call_id))
                if call_id is None or reply.call_id in (call_id, 0):
                    return reply
                if reply.call_id in self._unanswered:
                    self._kept[reply.call_id] = reply
        finally:
            if call_id is not None:  # answered, or given up after a timeout or a loss
                self._unanswered.discard(call_id)
                self._lost.discard(call_id)

    def _receive(self, call_id: int | None) -> bytes:
        """The next frame; raises ``KVStoreLost`` once ``call_id``'s connection has closed,
        ``KVStoreTimeout`` after ``timeout_ms`` without a frame."""
        spin_until = time.perf_counter() + self.spin_s
        while time.perf_counter() < spin_until:
            try:
                frame: bytes = self._sock.recv(zmq.NOBLOCK)
                return frame
            except zmq.Again:
                continue
        deadline = time.monotonic() + self.timeout_ms / 1000
        while True:
            lost = call_id in self._lost  # then only what came before the loss is read
            wait_ms = 0 if lost else max(int((deadline - time.monotonic()) * 1000), 0)
            ready = dict(self._poller.poll(wait_ms))
            if self._sock in ready:
                frame = self._sock.recv()
                return frame
            if lost:
                raise KVStoreLost(f"the connection to {self.endpoint} closed before the reply")
            if self._monitor in ready:
                self._take_disconnects()
            elif time.monotonic() >= deadline:
                raise KVStoreTimeout(f"no reply from {self.endpoint} in {self.timeout_ms} ms")

    def _take_disconnects(self) -> None:
        """Reads the monitor's events: at a disconnection, every call unanswered then is lost
        (its reply, if the daemon sent one, was not received: it never will be); if none was,
        the next call is."""
        while self._monitor_ready():
            event = parse_monitor_message(self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._lost |= self._unanswered
                self._lose_next = not self._unanswered

    def _monitor_ready(self) -> bool:
        return bool(int(self._monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def close(self) -> None:
        if self._sock.closed:
            return
        self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
