"""What ``pagedserve up`` checks before it starts anything: that the gateway's port and the
kvstore's endpoint are free, each refusal one line."""

from __future__ import annotations

import errno
import socket


def check_port_free(host: str, port: int) -> None:
    """Exits with one line if the gateway could not listen on ``host:port`` (before anything
    is started)."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise SystemExit(f"pagedserve up: --host {host}: {err}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp does
            try:
                sock.bind(address)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    raise SystemExit(
                        f"pagedserve up: port {port} on {host} is in use; pass --port"
                    ) from None
                raise SystemExit(f"pagedserve up: cannot listen on {host}:{port}: {err}") from None


def check_endpoint_free(endpoint: str) -> None:
    """Exits with one line if a kvstore (or anything) already listens at the kvstore's
    ``endpoint`` (before anything is started)."""
    from contracts.endpoints import env_token
    from kvstore.security import endpoint_in_use

    taken = endpoint_in_use(endpoint, env_token())
    if taken is not None:
        raise SystemExit(f"pagedserve up: {taken}; stop it or pass another --endpoint")
