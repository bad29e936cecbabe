"""``pagedserve kvstore``: the KV-cache daemon process.

One thread: a ZeroMQ ROUTER socket polled with a short timeout; each frame is decoded, handled
by the ``Host`` (one ``KVService`` per pool) and answered (errors included: a malformed frame, a
wrong protocol version, a missing or wrong token or a handler failure get an ``Error`` reply and
the loop goes on). Between frames it expires leases.

Startup order: check the endpoint and bind it (fast: a refused endpoint costs no allocation),
remove dead daemons' pool files, allocate the pools, serve. See ``kvstore.security`` for the
token and the endpoint rules.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time

import msgspec
import zmq

from contracts import options
from contracts.endpoints import TOKEN_ENV, env_token
from contracts.heap import tune_gc_for_serving
from kvstore import protocol as p
from kvstore.config import KVStoreConfig
from kvstore.host import Host
from kvstore.security import (
    EndpointError,
    check_endpoint,
    ipc_path,
    prepare_ipc_path,
    token_matches,
)
from kvstore.startup import build_host, disable_expandable_segments

__all__ = ["Daemon", "KVStoreConfig", "disable_expandable_segments", "run"]

log = logging.getLogger("pagedserve.kvstore")
REFUSAL_LOG_INTERVAL_S = 10.0


class RefusalLog:
    """Counts refused (unauthorized) calls and logs them at most once per ``interval_s``: a
    client flooding the daemon with bad frames costs a log line every ``interval_s``, not one
    per frame. ``flush`` logs what is pending once the interval has passed (or at once)."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.pending = 0
        self.total = 0
        self.last_kind = ""
        self._last_log = -math.inf

    def refused(self, kind: str) -> None:
        self.pending += 1
        self.total += 1
        self.last_kind = kind
        self.flush()

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.pending or (not force and now - self._last_log < self.interval_s):
            return
        log.warning(
            "refused %d unauthorized call(s) (last: %s): their token is missing or is not this "
            "kvstore's %s",
            self.pending,
            self.last_kind,
            TOKEN_ENV,
        )
        self.pending = 0
        self._last_log = now


class Daemon:
    """Binds ``endpoint`` at construction (raises ``EndpointError`` with a one-line reason if it
    must not or cannot), serves ``service`` in ``serve_forever``. ``token``: when non-empty,
    calls must carry it."""

    def __init__(self, endpoint: str, token: str = "", busy_poll: bool = False) -> None:
        check_endpoint(endpoint, token)
        self.endpoint = endpoint
        self.service: Host | None = None
        self.poll_ms = 0 if busy_poll else 100
        self.stopping = False
        self.refusals = RefusalLog()
        self.stale_socket_removed = False
        self._token = token.encode("utf-8", "surrogateescape")
        self._ipc_path = ipc_path(endpoint)
        self._ipc_inode: tuple[int, int] | None = None
        if self._ipc_path is not None:
            self.stale_socket_removed = prepare_ipc_path(self._ipc_path, token)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            self._bind()
        except zmq.ZMQError as err:
            self.sock.close()
            self.ctx.term()
            hint = " (another kvstore on this port?)" if err.errno == zmq.EADDRINUSE else ""
            raise EndpointError(
                f"cannot bind {endpoint}: {zmq.strerror(err.errno or 0)}{hint}"
            ) from None

    def _bind(self) -> None:
        if self._ipc_path is None:
            self.sock.bind(self.endpoint)
            return
        old_umask = os.umask(0o077)  # the socket file is never open to others, not even briefly
        try:
            self.sock.bind(self.endpoint)
        finally:
            os.umask(old_umask)
        os.chmod(self._ipc_path, 0o600)
        st = os.stat(self._ipc_path)
        self._ipc_inode = (st.st_dev, st.st_ino)

    def reply_to(self, frames: list[bytes]) -> bytes:
        """The encoded reply to one received message (never raises)."""
        call_id = 0
        try:
            if len(frames) != 1:
                raise ValueError(f"expected one payload frame, got {len(frames)}")
            try:
                call = p.decode_call(frames[0])
            except (msgspec.DecodeError, msgspec.ValidationError):
                # Only now look at the header: another version, or garbage?
                version, peeked_id = p.peek_header(frames[0])
                call_id = peeked_id or 0
                if version is None or version == p.PROTOCOL_VERSION:
                    raise
                return self._error(
                    call_id, "version", f"protocol version {version} is not {p.PROTOCOL_VERSION}"
                )
            call_id = call.call_id
            if call.version != p.PROTOCOL_VERSION:
                return self._error(
                    call_id,
                    "version",
                    f"protocol version {call.version} is not {p.PROTOCOL_VERSION}",
                )
            if self._token and not token_matches(self._token, call.token):
                self.refusals.refused(type(call.body).__name__)
                return self._error(
                    call_id, "unauthorized", f"the call's token is missing or is not {TOKEN_ENV}"
                )
            assert self.service is not None, "serve_forever sets the service"
            body = self.service.handle(call.body)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as err:
            body = p.Error("bad_message", f"cannot decode the message: {err}")
        except Exception as err:  # the daemon keeps serving whatever a handler does
            log.exception("handler failed")
            body = p.Error("internal", f"{type(err).__name__}: {err}")
        return p.encode(p.Reply(p.PROTOCOL_VERSION, call_id, body))

    @staticmethod
    def _error(call_id: int, code: p.ErrorCode, message: str) -> bytes:
        return p.encode(p.Reply(p.PROTOCOL_VERSION, call_id, p.Error(code, message)))

    def serve_forever(self, service: Host) -> None:
        self.service = service
        if self._token:
            log.info("kvstore serving on %s; calls must carry %s", self.endpoint, TOKEN_ENV)
        else:
            log.info("kvstore serving on %s (socket mode 0600, no token)", self.endpoint)
        last_tick = time.monotonic()
        while not self.stopping:
            if self.sock.poll(self.poll_ms):
                identity, *frames = self.sock.recv_multipart()
                start = time.perf_counter()
                self.sock.send_multipart([identity, self.reply_to(frames)])
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("call answered in %.3f ms", (time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            if not self.sock.poll(0):  # no message waits: copy ahead of evictions
                service.between_calls()
            spent = time.perf_counter() - start
            if spent > 1e-4 and log.isEnabledFor(logging.DEBUG):
                log.debug("between calls: %.3f ms", spent * 1e3)
            if time.monotonic() - last_tick >= 0.5:
                service.tick()
                self.refusals.flush()
                last_tick = time.monotonic()

    def close(self) -> None:
        """Closes the socket and removes its ipc file (only if it is still the one bound here)."""
        self.refusals.flush(force=True)
        self.sock.close()
        self.ctx.term()
        if self._ipc_path is not None and self._ipc_inode is not None:
            try:
                st = os.stat(self._ipc_path)
            except FileNotFoundError:
                return
            if (st.st_dev, st.st_ino) == self._ipc_inode:
                os.unlink(self._ipc_path)


def run(config: KVStoreConfig) -> None:
    """Binds, allocates, serves until SIGINT/SIGTERM. A refused endpoint exits non-zero with one
    line on stderr before anything is logged or allocated; a bad flag, with one line too."""
    try:
        daemon = Daemon(config.endpoint, env_token(), config.busy_poll)
    except EndpointError as err:
        raise SystemExit(f"pagedserve kvstore: {err}") from None
    options.configure_logging(config.log_level)
    if daemon.stale_socket_removed:
        log.info("replaced a stale socket file (no daemon answered on it) at %s", config.endpoint)
    try:
        host, pools = build_host(config)
    except ValueError as err:
        daemon.close()
        raise SystemExit(f"pagedserve kvstore: {err}") from None
    except BaseException:
        daemon.close()
        raise

    def stop(signum: int, _frame: object) -> None:
        if not daemon.stopping:  # Ctrl-C reaches us from the terminal and from `pagedserve up`
            log.info("signal %d: shutting down", signum)
        daemon.stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    tune_gc_for_serving()
    try:
        daemon.serve_forever(host)
    finally:
        daemon.close()
        for pool in pools:
            pool.close()
        log.info("kvstore stopped")
