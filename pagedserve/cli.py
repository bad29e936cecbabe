"""``pagedserve``: one console script, a subcommand per process.

- ``pagedserve kvstore``: the KV-cache daemon.
- ``pagedserve compute``: a compute worker.
- ``pagedserve gateway``: the HTTP gateway (OpenAI-compatible API, /health, /metrics, /admin/).
- ``pagedserve up``: the whole stack (an embedded Redis unless REDIS_URL is set, the kvstore,
  the workers, the gateway) until Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compute.scheduler import SchedulerConfig
from compute.worker import ComputeConfig
from gateway.config import ADMIN_TOKEN_ENV, GatewayConfig
from kvstore.daemon import DEFAULT_ENDPOINT, KVStoreConfig
from pagedserve.config import add_arguments, from_namespace

log = logging.getLogger("pagedserve")


@dataclass(frozen=True)
class UpConfig:
    model: str = field(
        default="tiny",
        metadata={
            "help": "local Hugging Face checkpoint directory or 'tiny' (kvstore, workers, gateway)"
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "help": "'cuda', 'cpu' or 'auto': cuda when there is a GPU (kvstore and workers)"
        },
    )
    workers: int = field(default=1, metadata={"help": "compute workers to start"})
    host: str = field(default="127.0.0.1", metadata={"help": "the gateway's listen address"})
    port: int = field(default=8000, metadata={"help": "the gateway's TCP port"})
    endpoint: str = field(default=DEFAULT_ENDPOINT, metadata={"help": "kvstore endpoint"})
    kvstore_args: str = field(
        default="",
        metadata={
            "help": 'extra flags for `pagedserve kvstore`, e.g. "--kv-memory 2 --swap-memory 8"'
        },
    )
    compute_args: str = field(
        default="",
        metadata={"help": 'extra flags for each `pagedserve compute`, e.g. "--max-num-seqs 64"'},
    )
    gateway_args: str = field(
        default="",
        metadata={"help": 'extra flags for `pagedserve gateway`, e.g. "--max-n 16"'},
    )
    startup_timeout_s: float = field(
        default=300.0, metadata={"help": "how long to wait for every process to become healthy"}
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
        "set, else a generated one).",
    )
    add_arguments(up, UpConfig)
    args = parser.parse_args(argv)
    if args.command == "kvstore":
        from kvstore.daemon import run

        run(from_namespace(KVStoreConfig, args))
    elif args.command == "compute":
        from compute.worker import run as run_compute

        run_compute(from_namespace(ComputeConfig, args), from_namespace(SchedulerConfig, args))
    elif args.command == "gateway":
        from gateway.app import run as run_gateway

        run_gateway(from_namespace(GatewayConfig, args))
    else:
        run_up(from_namespace(UpConfig, args))


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
    """Starts Redis, the kvstore, the workers and the gateway, waits until the workers have
    registered and the gateway is healthy, prints where. Ctrl-C stops them all: the gateway
    first (requests in flight finish), then the workers (they drain their requests), the
    kvstore, Redis; a second Ctrl-C makes the workers stop at once."""
    import shlex

    from pagedserve.redis_server import EmbeddedRedis

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    shared = ["--model", config.model, "--device", config.device]
    admin_token = os.environ.get(ADMIN_TOKEN_ENV) or secrets.token_urlsafe(24)
    redis = EmbeddedRedis.start()
    log.info("redis at %s", redis.url)
    kvstore: list[subprocess.Popen[bytes]] = []
    workers: list[subprocess.Popen[bytes]] = []
    gateway: list[subprocess.Popen[bytes]] = []
    try:
        # Children get their own session: a terminal Ctrl-C reaches only us, and we stop them
        # in order (a worker drains against a kvstore that is still up).
        kv_flags = [*shared, *shlex.split(config.kvstore_args)]
        kvstore.append(
            spawn_kvstore(
                config.endpoint, kv_flags, config.startup_timeout_s, start_new_session=True
            )
        )
        worker_flags = [
            *shared,
            "--kvstore",
            config.endpoint,
            "--redis-url",
            redis.url,
            *shlex.split(config.compute_args),
        ]
        for _ in range(config.workers):
            workers.append(spawn_process("compute", worker_flags, start_new_session=True))
        gateway_flags = [
            "--model",
            config.model,
            "--host",
            config.host,
            "--port",
            str(config.port),
            "--redis-url",
            redis.url,
            "--kvstore",
            config.endpoint,
            *shlex.split(config.gateway_args),
        ]
        env = {**os.environ, ADMIN_TOKEN_ENV: admin_token}
        gateway.append(spawn_process("gateway", gateway_flags, start_new_session=True, env=env))
        processes = kvstore + workers + gateway
        wait_for_workers(config.endpoint, config.workers, processes, config.startup_timeout_s)
        url = f"http://{_url_host(config.host)}:{config.port}"
        wait_for_health(url, processes, config.startup_timeout_s)
        print(_banner(config, url, redis.url, admin_token), flush=True)
        while all(process.poll() is None for process in processes):
            time.sleep(0.5)
        log.error("a process exited: %s", [p.returncode for p in processes])
    except KeyboardInterrupt:
        log.info("stopping (Ctrl-C again: workers stop without draining)")
    finally:
        _stop_group(gateway)
        _stop_group(workers)
        _stop_group(kvstore)
        redis.stop()


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _banner(config: UpConfig, url: str, redis_url: str, admin_token: str) -> str:
    model = GatewayConfig(model=config.model).model_name()
    body = f'{{"model": "{model}", "prompt": "Hello", "max_tokens": 16, "stream": true}}'
    return (
        f"pagedserve is up at {url} (redis {redis_url}, kvstore {config.endpoint}, "
        f"{config.workers} worker(s)). Ctrl-C stops it.\n"
        f"admin token ({ADMIN_TOKEN_ENV}): {admin_token}\n"
        f"try: curl -N {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'"
    )


def wait_for_health(url: str, processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Until ``GET {url}/health`` answers 200."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if any(process.poll() is not None for process in processes):
            raise SystemExit("a process exited during startup")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as err:
            last = err.read().decode(errors="replace")
        except OSError as err:
            last = str(err)
        time.sleep(0.2)
    raise SystemExit(f"the gateway at {url} is not healthy after {timeout_s} s: {last}")


def _stop_group(processes: list[subprocess.Popen[bytes]], timeout_s: float = 120.0) -> None:
    """SIGINT to each; wait. Another Ctrl-C meanwhile sends each a second SIGINT (stop now);
    past ``timeout_s`` they are killed."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        while process.poll() is None:
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except KeyboardInterrupt:
                for other in processes:
                    if other.poll() is None:
                        other.send_signal(signal.SIGINT)
            except subprocess.TimeoutExpired:
                process.kill()


def spawn_process(command: str, flags: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """`pagedserve <command> <flags>` as a child process, this checkout on its PYTHONPATH
    (``env``, if given, replaces ``os.environ`` otherwise)."""
    root = str(Path(__file__).resolve().parent.parent)
    base = popen.pop("env", None) or os.environ
    env = {**base, "PYTHONPATH": os.pathsep.join([root, base.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pagedserve.cli", command, *flags]
    return subprocess.Popen(cmd, env=env, **popen)


def wait_for_workers(
    endpoint: str, count: int, processes: list[subprocess.Popen[bytes]], timeout_s: float
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
            if len(stats.workers) >= count:  # type: ignore[union-attr]
                return
            time.sleep(0.5)
    raise SystemExit(f"{count} workers not registered after {timeout_s} s")


if __name__ == "__main__":
    main()
