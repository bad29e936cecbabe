"""``pagedserve``: one console script, a subcommand per process.

- ``pagedserve kvstore``: the KV-cache daemon.
- ``pagedserve up``: everything that exists so far (an embedded Redis and the kvstore), until
  Ctrl-C. Compute workers and the gateway join it in later releases.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.daemon import DEFAULT_ENDPOINT, KVStoreConfig
from pagedserve.config import add_arguments, from_namespace

log = logging.getLogger("pagedserve")


@dataclass(frozen=True)
class UpConfig:
    kvstore_args: str = field(
        default="",
        metadata={
            "help": 'extra flags passed to `pagedserve kvstore`, e.g. "--device cpu --kv-memory 2"'
        },
    )
    endpoint: str = field(default=DEFAULT_ENDPOINT, metadata={"help": "kvstore endpoint"})
    startup_timeout_s: float = field(
        default=120.0, metadata={"help": "how long to wait for every process to become healthy"}
    )


def main(argv: list[str] | None = None) -> None:
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
    up = sub.add_parser("up", help="run the whole stack until Ctrl-C")
    add_arguments(up, UpConfig)
    args = parser.parse_args(argv)
    if args.command == "kvstore":
        from kvstore.daemon import run

        run(from_namespace(KVStoreConfig, args))
    else:
        run_up(from_namespace(UpConfig, args))


def spawn_kvstore(
    endpoint: str, flags: list[str], timeout_s: float = 120.0, **popen: Any
) -> subprocess.Popen[bytes]:
    """Starts `pagedserve kvstore` as a child process (this checkout on its PYTHONPATH) and
    returns once it answers a ping."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pagedserve.cli", "kvstore", "--endpoint", endpoint, *flags]
    process = subprocess.Popen(cmd, env=env, **popen)
    try:
        wait_for_kvstore(endpoint, process, timeout_s)
    except BaseException:
        process.kill()
        raise
    return process


def wait_for_kvstore(endpoint: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
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


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_up(config: UpConfig) -> None:
    """Starts every process, waits until each is healthy, prints where; Ctrl-C stops them all."""
    import shlex

    from pagedserve.redis_server import EmbeddedRedis

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    redis = EmbeddedRedis.start()
    log.info("redis at %s", redis.url)
    kvstore: subprocess.Popen[bytes] | None = None
    try:
        flags = shlex.split(config.kvstore_args)
        kvstore = spawn_kvstore(config.endpoint, flags, config.startup_timeout_s)
        print(
            f"pagedserve is up: redis {redis.url}, kvstore {config.endpoint}. Ctrl-C stops it.",
            flush=True,
        )
        while kvstore.poll() is None:
            time.sleep(0.5)
        log.error("kvstore exited with %s", kvstore.returncode)
    except KeyboardInterrupt:
        log.info("stopping")
    finally:
        if kvstore is not None and kvstore.poll() is None:
            kvstore.send_signal(signal.SIGINT)
            try:
                kvstore.wait(10)
            except subprocess.TimeoutExpired:
                kvstore.kill()
        redis.stop()


if __name__ == "__main__":
    main()
