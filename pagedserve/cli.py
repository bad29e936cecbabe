"""``pagedserve``: one console script, a subcommand per process.

- ``pagedserve kvstore``: the KV-cache daemon.
- ``pagedserve compute``: a compute worker.
- ``pagedserve gateway``: the HTTP gateway (OpenAI-compatible API, /health, /metrics, /admin/).
- ``pagedserve up``: the whole stack (an embedded, durable Redis unless REDIS_URL is set, the
  kvstore, the workers, the gateway), supervised (``pagedserve.supervisor``) until Ctrl-C.
- ``pagedserve convert``: a GGUF model made into a checkpoint ahead of time (each process
  converts it on first use otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, overload

from compute.scheduler import SchedulerConfig
from compute.worker import ComputeConfig
from gateway.config import ADMIN_TOKEN_ENV, GatewayConfig
from kvstore.daemon import KVStoreConfig
from pagedserve.bench import BenchConfig
from pagedserve.config import T, add_arguments, from_namespace
from pagedserve.convert import ConvertConfig
from pagedserve.up import UpConfig, run_up


def build_parser() -> argparse.ArgumentParser:
    """`pagedserve`'s parser: a subcommand per process, its flags from the config dataclasses."""
    parser = argparse.ArgumentParser(
        prog="pagedserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    kv = sub.add_parser(
        "kvstore",
        help="run the KV-cache daemon",
        description="The KV-cache daemon: owns the GPU block pool, the prefix "
        "index, the CPU swap tier and the swap-vs-recompute cost model.",
    )
    add_arguments(kv, KVStoreConfig)
    compute = sub.add_parser(
        "compute",
        help="run a compute worker",
        description="A compute worker: pulls requests from Redis, runs the model over the "
        "kvstore's paged pool, streams tokens back to Redis.",
    )
    add_arguments(compute, ComputeConfig)
    add_arguments(compute, SchedulerConfig)
    gateway = sub.add_parser(
        "gateway",
        help="run the HTTP gateway",
        description="The HTTP gateway: an OpenAI-compatible API (/v1/completions, "
        "/v1/chat/completions, /v1/models) over the Redis request queue, /health, /metrics, "
        f"and the admin API under /admin/ (bearer token from ${ADMIN_TOKEN_ENV}; unset, the "
        "admin API answers 403).",
    )
    add_arguments(gateway, GatewayConfig)
    up = sub.add_parser(
        "up",
        help="run the whole stack until Ctrl-C",
        description="Starts Redis (embedded unless REDIS_URL is set), the kvstore, the compute "
        f"workers and the gateway; prints the URL and the admin token (${ADMIN_TOKEN_ENV} if "
        "set, else a generated one). Then supervises them: a child that exits is restarted "
        "with exponential backoff (a worker under the same --worker-id, so it takes its "
        "requests back; redis-server on the same port and directory, so it reloads its "
        "append-only file); a child that keeps failing stops the stack with exit status 1. "
        "An external Redis (REDIS_URL) is pinged and its outages logged. Ctrl-C or SIGTERM "
        "stops the gateway, the workers (they drain; Ctrl-C again: at once), the kvstore, "
        "Redis, and exits 0.",
    )
    add_arguments(up, UpConfig)
    bench = sub.add_parser(
        "bench",
        help="measure a server over HTTP",
        description="A serving benchmark over HTTP for any OpenAI-compatible server: streamed "
        "requests (a burst or Poisson arrivals; random, shared-prefix or multi-turn workloads, "
        "seeded), then throughput, TTFT/TPOT/ITL/end-to-end percentiles and goodput.",
    )
    add_arguments(bench, BenchConfig)
    convert = sub.add_parser(
        "convert",
        help="convert a GGUF model into a checkpoint",
        description="Dequantizes a GGUF --model (a .gguf file, a directory holding one, or "
        "'smollm2') once into a float32 safetensors checkpoint in the cache directory and "
        "prints its path; a model converted before is found at once. Every process does this "
        "on first use (one at a time, under a file lock); `up` does it before it starts them.",
    )
    add_arguments(convert, ConvertConfig)
    return parser


def main(argv: list[str] | None = None) -> None:
    if not faulthandler.is_enabled():  # a crash in native code (SIGSEGV, SIGABRT) logs its place
        with contextlib.suppress(io.UnsupportedOperation, ValueError):  # stderr with no file
            faulthandler.enable()
    parser = build_parser()
    args = parser.parse_args(argv)

    def config(cls: type[T]) -> T:
        try:
            return from_namespace(cls, args)
        except ValueError as error:  # a value the config refuses: one line, no traceback
            parser.error(str(error))

    if args.command == "kvstore":
        from kvstore.daemon import run

        run(config(KVStoreConfig))
    elif args.command == "compute":
        from compute.worker import run as run_compute

        run_compute(config(ComputeConfig), config(SchedulerConfig))
    elif args.command == "gateway":
        from gateway.app import run as run_gateway

        run_gateway(config(GatewayConfig))
    elif args.command == "bench":
        from pagedserve.bench import run as run_bench

        run_bench(config(BenchConfig))
    elif args.command == "convert":
        from pagedserve.convert import run_convert

        run_convert(config(ConvertConfig))
    else:
        run_up(config(UpConfig))


def spawn_kvstore(
    endpoint: str, flags: list[str], timeout_s: float = 120.0, **popen: Any
) -> subprocess.Popen[bytes]:
    """Starts `pagedserve kvstore` as a child process and returns once it answers a ping."""
    process = spawn_process("kvstore", ["--endpoint", endpoint, *flags], **popen)
    try:
        wait_for_kvstore(endpoint, process, timeout_s)
    except BaseException:
        process.kill()
        raise
    return process


def wait_for_kvstore(endpoint: str, process: subprocess.Popen[Any], timeout_s: float) -> None:
    """Until the kvstore at ``endpoint`` answers a ping; exits if ``process`` (it) exits."""
    from kvstore import protocol as p
    from kvstore.client import KVClient, KVStoreTimeout

    client = KVClient(endpoint, timeout_s=1.0)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"kvstore exited with {process.returncode}")
            try:
                client.call(p.Ping())
                return
            except KVStoreTimeout:
                continue
        raise SystemExit(f"kvstore not healthy after {timeout_s} s")
    finally:
        client.close()


@overload
def spawn_process(
    command: str, flags: list[str], *, text: Literal[True], **popen: Any
) -> subprocess.Popen[str]: ...
@overload
def spawn_process(
    command: str, flags: list[str], *, text: Literal[False] = False, **popen: Any
) -> subprocess.Popen[bytes]: ...
def spawn_process(command: str, flags: list[str], **popen: Any) -> subprocess.Popen[Any]:
    """`pagedserve <command> <flags>` as a child process, this checkout on its PYTHONPATH
    (``env``, if given, replaces ``os.environ`` otherwise); ``popen``: ``subprocess.Popen``'s
    keywords (``text=True``: its pipes carry ``str``)."""
    root = str(Path(__file__).resolve().parent.parent)
    base = popen.pop("env", None) or os.environ
    env = {**base, "PYTHONPATH": os.pathsep.join([root, base.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pagedserve.cli", command, *flags]
    return subprocess.Popen(cmd, env=env, **popen)


def wait_for_workers(
    endpoint: str, count: int, processes: Sequence[subprocess.Popen[Any]], timeout_s: float
) -> None:
    """Until ``count`` workers are registered at the kvstore (they load and profile first)."""
    from kvstore import protocol as p
    from kvstore.client import KVClient

    deadline = time.monotonic() + timeout_s
    with KVClient(endpoint, timeout_s=5) as client:
        while time.monotonic() < deadline:
            if any(process.poll() is not None for process in processes):
                raise SystemExit("a process exited during startup")
            stats = client.call(p.GetStats(0))
            if len(stats.workers) >= count:
                return
            time.sleep(0.5)
    raise SystemExit(f"{count} workers not registered after {timeout_s} s")


if __name__ == "__main__":
    main()
