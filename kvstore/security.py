"""Who may call the kvstore, and where it listens: the daemon's side. Torch-free.

- **Token**: ``$PAGEDSERVE_KVSTORE_TOKEN`` (``contracts.endpoints.TOKEN_ENV``) is a shared
  secret. A daemon started with it set answers ``Error("unauthorized")`` to every call whose
  ``Call.token`` differs; clients send the one in their own environment. Never on a command
  line, never logged.
- **Endpoints**: the default is ``ipc://<runtime dir>/kvstore.sock``
  (``contracts.endpoints.default_endpoint``), a socket file only this user can open. Any endpoint
  other than a socket file (``tcp://``, an abstract ``ipc://@name``) is reachable by others, so the
  daemon binds one only with a token (``check_endpoint``). Before binding an ipc path,
  ``prepare_ipc_path`` makes its directory private and tells a live daemon's socket (refuse) from a
  dead one's (remove); ``endpoint_in_use`` tells the same before anything is started.
"""

from __future__ import annotations

import errno
import hmac
import os
import socket
import stat

import zmq

from contracts.endpoints import TOKEN_ENV, runtime_dir
from kvstore import protocol as p

PING_TIMEOUT_S = 1.0


class EndpointError(Exception):
    """The daemon must not serve on this endpoint; the message is one line for the operator."""


def token_matches(expected: bytes, given: str) -> bool:
    """Constant-time comparison of a call's token with the daemon's (``expected``: UTF-8)."""
    return hmac.compare_digest(expected, given.encode("utf-8", "surrogateescape"))


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an ``ipc://`` endpoint (absolute); None for any other endpoint,
    an abstract ``ipc://@name`` included (it has no file)."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    return os.path.abspath(endpoint.removeprefix("ipc://"))


def check_endpoint(endpoint: str, token: str) -> None:
    """Raises ``EndpointError`` for an endpoint other processes or hosts can reach when no token
    is set: anything but an ``ipc://`` socket file."""
    scheme, sep, address = endpoint.partition("://")
    if not sep or not address:
        raise EndpointError(f"endpoint {endpoint!r}: expected ipc:///path or tcp://host:port")
    if token or ipc_path(endpoint) is not None:
        return
    what = "an abstract ipc://@ socket" if scheme == "ipc" else f"a {scheme}:// endpoint"
    raise EndpointError(
        f"{what} needs {TOKEN_ENV} set (a shared secret), or use an ipc:// endpoint"
    )


def prepare_ipc_path(path: str, token: str, default_dir: str | None = None) -> bool:
    """Readies ``path`` for binding; returns whether a stale socket file was removed.

    A missing parent directory is created with mode 0700. An existing one that is the default
    runtime directory (``default_dir``, default: ``runtime_dir()``) must be a directory owned by
    this user with no group or other permissions. An existing socket file is a live daemon's if
    something accepts connections on it: refused (a kvstore answers a ``Ping`` within
    ``PING_TIMEOUT_S``: "another kvstore is serving"); else it is stale and removed.
    Raises ``EndpointError``."""
    parent = os.path.dirname(path)
    default_dir = os.path.abspath(default_dir or runtime_dir())
    try:
        os.makedirs(parent, mode=0o700)
        os.chmod(parent, 0o700)  # whatever the umask
    except FileExistsError:
        if os.path.normpath(parent) == os.path.normpath(default_dir):
            _check_private_dir(parent)
    except OSError as err:
        raise EndpointError(f"cannot create {parent}: {err.strerror or err}") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as err:
        raise EndpointError(f"cannot inspect {path}: {err.strerror or err}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise EndpointError(f"{path} exists and is not a socket; remove it or use another path")
    taken = _listener(path, token)
    if taken is not None:
        raise EndpointError(f"{taken}; stop it or use another --endpoint")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        raise EndpointError(f"cannot remove the stale socket {path}: {err.strerror}") from None
    return True


def endpoint_in_use(endpoint: str, token: str) -> str | None:
    """Why a kvstore could not serve at the ``ipc://`` socket file ``endpoint`` now, in a few
    words ("another kvstore is serving at ..."), or None: nothing listens there (no file, or a
    dead daemon's). Other endpoints: None (their bind says it). For `pagedserve up`, which
    checks before it starts anything."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return f"{path} exists and is not a socket"
    except OSError:  # no such file (or no access: the daemon says why)
        return None
    try:
        return _listener(path, token)
    except EndpointError as err:
        return str(err)


def _listener(path: str, token: str) -> str | None:
    """What listens on the socket file ``path``: a kvstore (it answers a ``Ping``), another
    process, or nothing (None)."""
    if not _accepts_connections(path):
        return None
    if answers_ping(f"ipc://{path}", token, PING_TIMEOUT_S):
        return f"another kvstore is serving at ipc://{path}"
    return (
        f"another process is listening at {path} (no answer to a kvstore Ping in "
        f"{PING_TIMEOUT_S:g} s: a kvstore still starting?)"
    )


def _check_private_dir(path: str) -> None:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise EndpointError(f"{path} is not a directory (a symlink?); remove it")
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise EndpointError(
            f"{path} must be owned by uid {os.getuid()} with mode 0700; it is owned by uid "
            f"{st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}: fix or remove it"
        )


def _accepts_connections(path: str) -> bool:
    """Whether a process listens on the Unix socket ``path`` (refused: a dead daemon's file)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PING_TIMEOUT_S)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return False
    except FileNotFoundError:
        return False
    except TimeoutError:  # a full backlog: someone listens
        return True
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK):  # a full backlog, too
            return True
        raise EndpointError(f"cannot check the socket {path}: {err.strerror or err}") from None
    finally:
        probe.close()
    return True


def answers_ping(endpoint: str, token: str, timeout_s: float) -> bool:
    """Whether a kvstore answers a ``Ping`` at ``endpoint`` within ``timeout_s`` (any reply
    counts: one that refuses our token, or speaks another protocol version, is a kvstore)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(p.encode(p.Call(p.PROTOCOL_VERSION, 1, p.Ping(), token)))
        return bool(sock.poll(int(timeout_s * 1000)))
    finally:
        sock.close()
        ctx.term()
