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

from compute.batch.scheduler import SchedulerConfig
from compute.worker import ComputeConfig
from gateway.config import ADMIN_TOKEN_ENV, GatewayConfig
from kvstore.daemon import KVStoreConfig
from pagedserve.bench_config import BenchConfig
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
        from pagedserve.bench_run import run as run_bench

        run_bench(config(BenchConfig))
    elif args.command == "convert":
        from pagedserve.convert import run_convert

        run_convert(config(ConvertConfig))
    else:
        run_up(config(UpConfig))


if __name__ == "__main__":
    main()
