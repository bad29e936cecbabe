"""A client that sends its request headers slowly (slowloris) is cut off after
``--header-timeout-s``, through a real gateway and real sockets; whole requests are served."""

from __future__ import annotations

import socket
import time
import urllib.parse

from tests.stack import Stack

TIMEOUT_S = 2.0
BOUND_S = 20.0  # the connection is closed within this after the deadline, on a loaded machine


def closed_after(sock: socket.socket, every_s: float, limit_s: float) -> float:
    """Sends an ``a`` every ``every_s`` (one more character of a header value or a path that
    never ends) until the server closes the connection; returns how long that took (fails past
    ``limit_s``)."""
    started = time.monotonic()
    sock.settimeout(every_s)
    sent = 0
    while time.monotonic() - started < limit_s:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:  # still open: one more byte of the never-ending header
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - started
            sent += 1
        except ConnectionResetError:
            return time.monotonic() - started
    raise AssertionError(f"still open after {limit_s} s ({sent} header bytes sent)")


def test_slow_headers_are_cut_off_and_whole_requests_are_served(stack: Stack) -> None:
    with stack.gateway("--header-timeout-s", str(TIMEOUT_S)) as gateway:
        address = urllib.parse.urlsplit(gateway.url)
        host, port = address.hostname or "127.0.0.1", address.port or 80
        # A request line and a header that never ends, a byte every 0.2 s.
        with socket.create_connection((host, port), timeout=10) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            took = closed_after(slow, 0.2, TIMEOUT_S + BOUND_S)
        assert TIMEOUT_S - 0.5 <= took <= TIMEOUT_S + BOUND_S, took
        # A whole request is answered at once; the next one on its keep-alive connection gets
        # the same deadline, from the end of the response.
        with socket.create_connection((host, port), timeout=10) as whole:
            whole.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = whole.recv(4096)
            assert answer.startswith((b"HTTP/1.1 200", b"HTTP/1.1 503")), answer
            whole.sendall(b"GET /")  # the next request's line, never finished
            took = closed_after(whole, 0.2, TIMEOUT_S + BOUND_S)
        assert took <= TIMEOUT_S + BOUND_S
        assert gateway.process.poll() is None
        assert "Traceback" not in gateway.output(), gateway.output()
