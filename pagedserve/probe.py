"""Health probes, one per process, for container healthchecks and scripts.

    python -m pagedserve.probe kvstore tcp://kvstore:5555          # answers a Ping
    python -m pagedserve.probe worker tcp://kvstore:5555           # this host's worker is live
    python -m pagedserve.probe gateway http://127.0.0.1:8000/health  # answers 200

Exit 0 with one line on stdout when healthy; exit 1 with the reason on stderr otherwise (a probe
never hangs past its ``--timeout-s``). Torch-free: it imports only the kvstore client.

``worker`` asks the kvstore (``GetStats``) for a registered worker that spoke within
``--max-idle-s`` (an idle worker still steps every 100 ms). Without ``--worker-id`` it looks for
the default id of a worker started on this host, ``{hostname}-{pid}``: in a compute container,
the worker of that container.

A kvstore started with ``$PAGEDSERVE_KVSTORE_TOKEN`` set answers only calls that carry it: the
``kvstore`` and ``worker`` probes send the one in their environment (never a flag, so it stays
off command lines).
"""

from __future__ import annotations

import argparse
import http.client
import socket
import sys
import urllib.error
import urllib.request

import zmq

from contracts.endpoints import TOKEN_ENV
from kvstore import protocol as p
from kvstore.client import KVClient, KVStoreError, KVStoreTimeout


class ProbeFailed(Exception):
    """The process is not healthy; the message says why."""


def probe_kvstore(endpoint: str, timeout_s: float, token: str | None = None) -> str:
    """The kvstore at ``endpoint`` answers a ``Ping`` within ``timeout_s`` (``token``: None
    reads ``$PAGEDSERVE_KVSTORE_TOKEN``)."""
    reply = _kvstore_call(endpoint, p.Ping(), timeout_s, token)
    if not isinstance(reply, p.Pong):
        raise ProbeFailed(f"kvstore {endpoint}: unexpected reply {type(reply).__name__}")
    return f"kvstore {endpoint}: up {reply.uptime_s:.1f} s"


def probe_worker(
    endpoint: str,
    worker_id: str | None,
    max_idle_s: float,
    timeout_s: float,
    token: str | None = None,
) -> str:
    """The kvstore lists a worker (``worker_id``, else one named ``{hostname}-...``) that sent
    a message within ``max_idle_s``."""
    stats = _kvstore_call(endpoint, p.GetStats(top_prefixes=0), timeout_s, token)
    if not isinstance(stats, p.Stats):
        raise ProbeFailed(f"kvstore {endpoint}: unexpected reply {type(stats).__name__}")
    prefix = f"{socket.gethostname()}-"
    wanted = f"worker {worker_id!r}" if worker_id else f"a worker named {prefix}*"
    rows = [
        row
        for row in stats.workers
        if (row.worker_id == worker_id if worker_id else row.worker_id.startswith(prefix))
    ]
    if not rows:
        registered = sorted(row.worker_id for row in stats.workers) or "none"
        raise ProbeFailed(
            f"kvstore {endpoint}: {wanted} is not registered (registered: {registered})"
        )
    live = [row for row in rows if row.idle_s <= max_idle_s]
    if not live:
        idle = min(row.idle_s for row in rows)
        raise ProbeFailed(f"kvstore {endpoint}: {wanted} silent for {idle:.1f} s")
    row = min(live, key=lambda r: r.idle_s)
    return f"worker {row.worker_id} (pid {row.pid}, {row.device}): idle {row.idle_s:.2f} s"


def probe_gateway(url: str, timeout_s: float) -> str:
    """``GET url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status = response.status
    except urllib.error.HTTPError as error:  # 4xx/5xx: the gateway answered, unhealthy
        body = error.read(200).decode(errors="replace").strip()
        raise ProbeFailed(f"gateway {url}: HTTP {error.code} {body}") from None
    except (urllib.error.URLError, OSError) as error:  # refused, unresolvable, timed out
        raise ProbeFailed(f"gateway {url}: {getattr(error, 'reason', error)}") from None
    except (http.client.HTTPException, ValueError) as error:  # not HTTP there; a bad URL
        raise ProbeFailed(f"gateway {url}: {error!r}") from None
    if status != 200:
        raise ProbeFailed(f"gateway {url}: HTTP {status}")
    return f"gateway {url}: HTTP 200"


def _kvstore_call(
    endpoint: str, body: p.Request, timeout_s: float, token: str | None
) -> p.ReplyBody:
    try:
        with KVClient(endpoint, timeout_s=timeout_s, token=token) as client:
            return client.call(body)
    except KVStoreTimeout:
        raise ProbeFailed(f"kvstore {endpoint}: no reply in {timeout_s} s") from None
    except KVStoreError as error:
        if error.code == "unauthorized":
            raise ProbeFailed(
                f"kvstore {endpoint}: unauthorized: set {TOKEN_ENV} to the kvstore's token"
            ) from None
        raise ProbeFailed(f"kvstore {endpoint}: {error}") from None
    except zmq.ZMQError as error:  # a malformed endpoint
        raise ProbeFailed(f"kvstore {endpoint}: {error}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pagedserve.probe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="target", required=True)
    kv = sub.add_parser("kvstore", help=f"the kvstore answers a Ping (sends ${TOKEN_ENV} if set)")
    kv.add_argument("endpoint", help="the kvstore's endpoint, e.g. tcp://kvstore:5555")
    worker = sub.add_parser(
        "worker", help=f"a compute worker is registered and live (sends ${TOKEN_ENV} if set)"
    )
    worker.add_argument("endpoint", help="the kvstore's endpoint, e.g. tcp://kvstore:5555")
    worker.add_argument(
        "--worker-id",
        default=None,
        help="the worker's --worker-id (default: any worker named {hostname}-{pid}, "
        "the default id of a worker on this host)",
    )
    worker.add_argument(
        "--max-idle-s",
        type=float,
        default=p.LEASE_TIMEOUT_S,
        help="longest silence of a live worker, in seconds (default: "
        f"{p.LEASE_TIMEOUT_S:g}, the kvstore's default --lease-timeout-s)",
    )
    gateway = sub.add_parser("gateway", help="the gateway's health URL answers 200")
    gateway.add_argument("url", help="e.g. http://127.0.0.1:8000/health")
    for target in (kv, worker, gateway):
        target.add_argument(
            "--timeout-s",
            type=float,
            default=5.0,
            help="how long to wait for an answer (default: 5)",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.target == "kvstore":
            message = probe_kvstore(args.endpoint, args.timeout_s)
        elif args.target == "worker":
            message = probe_worker(args.endpoint, args.worker_id, args.max_idle_s, args.timeout_s)
        else:
            message = probe_gateway(args.url, args.timeout_s)
    except ProbeFailed as failure:
        print(f"unhealthy: {failure}", file=sys.stderr)
        return 1
    print(f"healthy: {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
