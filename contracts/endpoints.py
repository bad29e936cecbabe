"""Where the kvstore listens and the secret its callers send: shared by every process that
talks to it (the daemon, the workers, the gateway, ``up``, the probes). Torch-free.

The default endpoint is a socket file in a directory only this user can open:
``ipc://$XDG_RUNTIME_DIR/pagedserve/kvstore.sock``, or ``ipc://<tmp>/pagedserve-<uid>/kvstore.sock``
without ``XDG_RUNTIME_DIR``; every process computes it from its own environment. `pagedserve up`
gives each stack its own socket beside it, named after the stack's gateway port
(``stack_endpoint``), so stacks on two ports of one host need no flags. The daemon's checks
before it binds are in ``kvstore.security``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

TOKEN_ENV = "PAGEDSERVE_KVSTORE_TOKEN"
SOCKET_NAME = "kvstore.sock"
PORT_FIELD = "{port}"  # in `pagedserve up`'s --endpoint and --redis-dir: the gateway's port


def env_token(environ: Mapping[str, str] | None = None) -> str:
    """The token in ``environ`` (default: this process's environment); "" when unset."""
    return (os.environ if environ is None else environ).get(TOKEN_ENV, "")


def runtime_dir(
    environ: Mapping[str, str] | None = None, uid: int | None = None, tmpdir: str | None = None
) -> str:
    """``$XDG_RUNTIME_DIR/pagedserve`` when that variable holds an absolute path, else
    ``<tmpdir>/pagedserve-<uid>`` (defaults: this process's environment, uid and
    ``tempfile.gettempdir()``). Pure given all three arguments."""
    environ = os.environ if environ is None else environ
    xdg = environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg):
        return os.path.join(xdg, "pagedserve")
    uid = os.getuid() if uid is None else uid
    return os.path.join(tmpdir or tempfile.gettempdir(), f"pagedserve-{uid}")


def default_endpoint(
    environ: Mapping[str, str] | None = None, uid: int | None = None, tmpdir: str | None = None
) -> str:
    """``ipc://<runtime_dir(...)>/kvstore.sock``."""
    return f"ipc://{os.path.join(runtime_dir(environ, uid, tmpdir), SOCKET_NAME)}"


def stack_endpoint(
    environ: Mapping[str, str] | None = None, uid: int | None = None, tmpdir: str | None = None
) -> str:
    """``ipc://<runtime_dir(...)>/kvstore-{port}.sock``: the default kvstore endpoint of
    `pagedserve up`, a template whose ``{port}`` (``PORT_FIELD``) it replaces with its gateway's
    port (``for_port``)."""
    name = f"kvstore-{PORT_FIELD}.sock"
    return f"ipc://{os.path.join(runtime_dir(environ, uid, tmpdir), name)}"


def for_port(template: str, port: int) -> str:
    """``template`` with every ``{port}`` replaced by ``port`` (no other substitution: a path
    may hold other braces)."""
    return template.replace(PORT_FIELD, str(port))


DEFAULT_ENDPOINT = default_endpoint()
STACK_ENDPOINT = stack_endpoint()
