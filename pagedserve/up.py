"""`pagedserve up`: the whole stack in one command.

Starts Redis (an embedded, durable redis-server unless ``REDIS_URL`` is set), the kvstore, the
compute workers and the gateway, each once the one it needs is ready, prints the banner (URL,
admin token, a curl example), then supervises them (``pagedserve.supervisor``) until Ctrl-C or
SIGTERM. ``UpConfig`` is its flags (``pagedserve.cli`` turns it into ``pagedserve up``'s parser),
``run_up`` runs it. A stack's kvstore socket and Redis directory are named after its gateway port
(``{port}`` in their defaults), so stacks on two ports of one host need no other flag.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from contracts import options
from contracts.checkpoints import SMOLLM2
from contracts.endpoints import STACK_ENDPOINT, for_port
from contracts.options import flag
from contracts.queue_keys import check_node
from gateway.config import ADMIN_TOKEN_ENV, GatewayConfig
from gateway.metrics import MULTIPROC_ENV
from pagedserve.preflight import check_endpoint_free, check_port_free
from pagedserve.procs import spawn_process
from pagedserve.supervisor import (
    ChildSpec,
    Interrupted,
    RestartPolicy,
    StartupError,
    Supervisor,
    child_popen_options,
)

if TYPE_CHECKING:
    from pagedserve.redis_server import RedisServer

log = logging.getLogger("pagedserve")
EARLIER_REDIS_DIR = ".pagedserve/redis"  # every port's, before --redis-dir had {port} in it


@dataclass(frozen=True)
class UpConfig:
    model: str = options.model("; converted before the stack starts, if need be", SMOLLM2)
    device: str = options.device(
        "'cuda', 'cpu' or 'auto': cuda when there is a GPU (kvstore and workers)"
    )
    workers: int = flag(
        1,
        "compute workers to start; worker i runs as --worker-id {hostname}-{port}-w{i} "
        "(port: the gateway's), so a restarted worker comes back under its id and takes "
        "its pending requests back",
    )
    data_parallel_size: int = flag(
        1,
        "GPUs to serve on, one KV pool each, all owned by the one kvstore (pool i on cuda:i "
        "of CUDA_VISIBLE_DEVICES; on CPU, one /dev/shm pool each); --workers run on each. "
        'The gateway routes each request to a pool (--gateway-args "--routing ...")',
    )
    tensor_parallel_size: int = flag(
        1,
        "GPUs of each worker group (tensor parallelism): the kvstore splits each pool over them "
        "by KV heads and each worker runs as a group of that many rank processes; pool i's "
        "group on GPUs i*N to i*N+N-1 of CUDA_VISIBLE_DEVICES (on CPU, ranks over gloo). "
        "Needs a safetensors checkpoint",
    )
    node: str = flag(
        "",
        "this host's name when several hosts share one Redis (REDIS_URL): its workers and "
        "gateways use the streams pagedserve:requests:NODE:POOL, and a gateway elsewhere "
        'routes to it with --gateway-args "--nodes NODE=tcp://this-host:PORT" (give this '
        "stack a TCP --endpoint and $PAGEDSERVE_KVSTORE_TOKEN); empty: the first host",
    )
    gateways: int = flag(
        0,
        "gateway processes, all on --port (SO_REUSEPORT: the kernel spreads "
        "connections among them; /metrics sums their request metrics); 0: one per 4 CPU "
        "cores on a CUDA host, at most 4 a pool (1 with --device cpu)",
    )
    host: str = flag("127.0.0.1", "the gateway's listen address")
    port: int = flag(8000, "the gateway's TCP port")
    endpoint: str = flag(
        STACK_ENDPOINT,
        "the kvstore's endpoint; {port} stands for --port, so that each stack on "
        "this host has its own by default",
    )
    kvstore_args: str = flag(
        "",
        'extra flags for `pagedserve kvstore`, e.g. "--kv-memory 2 --swap-memory 8"',
    )
    compute_args: str = flag(
        "",
        'extra flags for each `pagedserve compute`, e.g. "--max-num-seqs 64"',
    )
    gateway_args: str = flag("", 'extra flags for `pagedserve gateway`, e.g. "--max-n 16"')
    startup_timeout_s: float = flag(
        900.0,
        "how long to wait for every process to become healthy (a worker loads its "
        "model and measures its prefill times first: minutes on a CPU)",
    )
    restart_backoff_s: float = flag(
        1.0,
        "once the stack is up, a child that exits (a worker, the kvstore, the "
        "gateway, the embedded redis-server) is restarted after this long, doubled for each "
        "further failure in a row, at most 30 s",
    )
    healthy_after_s: float = flag(
        60.0,
        "a child up this long is healthy again: failure count and backoff reset",
    )
    max_restarts: int = flag(
        5,
        "restart a child at most this many times in a row (each failure within "
        "--healthy-after-s of its start counts); if it fails again, stop everything and "
        "exit with status 1 (0: never restart)",
    )
    redis_dir: str = flag(
        ".pagedserve/redis-{port}",
        "the embedded Redis's directory (relative to the current one; {port} "
        "stands for --port): its append-only file (fsync every second), port and log; "
        "created mode 0700, never deleted, one `up` at a time (ignored with REDIS_URL)",
    )
    redis_port: int = flag(
        0,
        "the embedded Redis's port on 127.0.0.1; 0: the port of the last run "
        "(recorded in --redis-dir) if it is free, else a free one",
    )

    def gateway_processes(self, cores: int | None = None) -> int:
        """``--gateways``, or for 0 as many as ``cores`` (default: this process's) feed: on an
        H200 host of 16 cores, 4 gateways served the 1B shape 1.09x faster than one, with a
        smoother stream (BENCHMARKS.md, "The gateway")."""
        from contracts.model_config import resolve_device

        if self.gateways or not resolve_device(self.device).startswith("cuda"):
            return self.gateways or 1
        cores = cores or len(os.sched_getaffinity(0))
        return max(1, min(cores // 4, 4 * self.data_parallel_size))

    def kvstore_endpoint(self) -> str:
        """``endpoint`` for this stack (``{port}``: the gateway's port)."""
        return for_port(self.endpoint, self.port)

    def redis_directory(self) -> Path:
        """``redis_dir`` for this stack (``{port}``: the gateway's port), absolute."""
        return Path(for_port(self.redis_dir, self.port)).absolute()


def run_up(config: UpConfig) -> None:
    """Starts Redis, the kvstore, the workers and the gateway, waits until the workers have
    registered and the gateway is healthy, prints where, then supervises them (see
    ``pagedserve.supervisor``; ``UpConfig`` has the restart policy). Ctrl-C or SIGTERM stops
    them all: the gateway first (requests in flight finish), then the workers (they drain
    their requests; Ctrl-C again: at once), the kvstore, Redis; exit status 0. Exit status 1,
    after one line saying why: the gateway's port is taken, a child failed during startup, or
    one failed more than ``max_restarts`` times in a row."""
    from pagedserve.redis_server import RedisServer, RedisWatch

    options.configure_logging("INFO")
    try:
        policy = RestartPolicy(
            backoff_s=config.restart_backoff_s,
            healthy_after_s=config.healthy_after_s,
            max_restarts=config.max_restarts,
        )
        if config.node:
            check_node(config.node)
    except ValueError as err:
        raise SystemExit(f"pagedserve up: {err}") from None
    if config.gateways < 0:
        raise SystemExit(f"pagedserve up: --gateways {config.gateways}: 0 (auto) or more")
    check_port_free(config.host, config.port)
    check_endpoint_free(config.kvstore_endpoint())
    from pagedserve.convert import convert_before_start

    convert_before_start(config.model)
    external = os.environ.get("REDIS_URL")
    server: RedisServer | None = None
    if not external:
        _note_earlier_redis_dir(config)
        try:
            server = RedisServer.durable_in(config.redis_directory(), config.redis_port)
        except (RuntimeError, OSError) as err:
            raise SystemExit(f"pagedserve up: redis: {err}") from None
    redis_url = server.url if server is not None else str(external)
    supervisor = Supervisor(policy, on_tick=[RedisWatch(external).check] if external else [])
    metrics_dir = tempfile.mkdtemp(prefix="pagedserve-metrics-")  # the gateways' shared metrics
    supervisor.install_signal_handlers()
    failure, status = "", 0
    try:
        try:
            _start_stack(supervisor, config, server, redis_url, metrics_dir)
        except Interrupted:
            log.info("stopping during startup")
        except StartupError as err:
            failure = str(err)
        except Exception as err:  # a bug or an unexpected environment: one line, still
            log.debug("startup failed", exc_info=True)
            failure = f"startup failed: {type(err).__name__}: {err}"
        else:
            status = supervisor.run()
    finally:
        supervisor.stop()
        if server is not None:
            server.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if failure:
        raise SystemExit(f"pagedserve up: {failure}")
    raise SystemExit(status)


def _start_stack(
    supervisor: Supervisor,
    config: UpConfig,
    server: RedisServer | None,
    redis_url: str,
    metrics_dir: str,
) -> None:
    """Starts every child in order, each once the one it needs is ready; prints the banner.
    Several gateways share the port and keep their request metrics in ``metrics_dir``."""
    import shlex
    from functools import partial

    from pagedserve.probe import probe_gateway, probe_kvstore, probe_worker

    timeout_s, children = config.startup_timeout_s, child_popen_options()
    endpoint = config.kvstore_endpoint()
    if server is not None:
        redis_spec = ChildSpec(
            "redis-server", server.spawn, stop_order=3, stop_signal=signal.SIGTERM
        )
        supervisor.start(redis_spec)
        supervisor.wait_until(server.ping, timeout_s, "redis-server")
        log.info("redis at %s, append-only file in %s", redis_url, server.directory)
    shared = ["--model", config.model, "--device", config.device]
    kv_flags = ["--endpoint", endpoint, *shared, *shlex.split(config.kvstore_args)]
    kv_flags += ["--data-parallel-size", str(config.data_parallel_size)]
    tp = config.tensor_parallel_size
    kv_flags += ["--tensor-parallel-size", str(tp)] if tp > 1 else []
    supervisor.start(
        ChildSpec("kvstore", partial(spawn_process, "kvstore", kv_flags, **children), stop_order=2)
    )
    kvstore_ready = _ready(partial(probe_kvstore, endpoint, 1.0))
    supervisor.wait_until(kvstore_ready, timeout_s, "the kvstore")
    worker_flags = ["--model", config.model, "--kvstore", endpoint, "--redis-url", redis_url]
    worker_flags += ["--node", config.node] if config.node else []
    worker_flags += ["--tensor-parallel-size", str(tp)] if tp > 1 else []
    worker_flags += shlex.split(config.compute_args)
    ids = worker_ids(config)
    for worker_id, pool in zip(ids, worker_pools(config), strict=True):
        flags = [*worker_flags, "--worker-id", worker_id, "--pool", str(pool)]
        flags += ["--device", config.device]
        gpu = pool_gpus(config.device, pool, config.data_parallel_size, tp, os.environ)
        env = {**os.environ} if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        start = partial(spawn_process, "compute", flags, env=env, **children)
        supervisor.start(ChildSpec(f"worker {worker_id}", start, stop_order=1))
    log.info("workers %s: a restarted one keeps its id, takes its requests back", ", ".join(ids))
    gateway_flags = ["--model", config.model, "--host", config.host, "--port", str(config.port)]
    gateway_flags += ["--redis-url", redis_url, "--kvstore", endpoint]
    gateway_flags += ["--node", config.node] if config.node else []
    gateway_flags += shlex.split(config.gateway_args)
    admin_token = os.environ.get(ADMIN_TOKEN_ENV) or secrets.token_urlsafe(24)
    env = {**os.environ, ADMIN_TOKEN_ENV: admin_token}
    gateways = config.gateway_processes()
    if gateways > 1:
        gateway_flags.append("--reuse-port")
        env[MULTIPROC_ENV] = metrics_dir
    for i in range(gateways):
        gateway = partial(spawn_process, "gateway", gateway_flags, env=env, **children)
        name = "gateway" if gateways == 1 else f"gateway {i}"
        supervisor.start(ChildSpec(name, gateway, stop_order=0))
    registered = _ready(lambda: [probe_worker(endpoint, i, 60.0, 5.0) for i in ids])
    supervisor.wait_until(registered, timeout_s, "the workers")
    url = f"http://{_url_host(config.host)}:{config.port}"
    healthy = _ready(partial(probe_gateway, f"{url}/health", 2.0))
    supervisor.wait_until(healthy, timeout_s, f"the gateway at {url}")
    print(_banner(config, url, redis_url, admin_token, ids), flush=True)


def worker_ids(config: UpConfig) -> list[str]:
    """Stable across restarts of a worker and of `up`: ``{hostname}-{gateway port}-w{i}``,
    with several pools ``...-g{pool}-w{i}``."""
    host = socket.gethostname()
    if config.data_parallel_size == 1:
        return [f"{host}-{config.port}-w{i}" for i in range(config.workers)]
    return [
        f"{host}-{config.port}-g{pool}-w{i}"
        for pool in range(config.data_parallel_size)
        for i in range(config.workers)
    ]


def worker_pools(config: UpConfig) -> list[int]:
    """The pool of each of ``worker_ids``."""
    return [pool for pool in range(config.data_parallel_size) for _ in range(config.workers)]


def pool_gpus(device: str, pool: int, pools: int, ranks: int, env: Mapping[str, str]) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` of a worker of pool ``pool`` whose group has ``ranks``
    ranks (the kvstore's ``cuda:pool*ranks`` to ``cuda:pool*ranks+ranks-1``, of the GPUs ``env``
    makes visible), so that it sees its GPUs alone, rank 0's first; None: one GPU in all, or
    CPU."""
    if pools * ranks == 1:
        return None
    from contracts.model_config import resolve_device

    if not resolve_device(device).startswith("cuda"):
        return None
    visible = [g.strip() for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    mine = range(pool * ranks, pool * ranks + ranks)
    return ",".join(visible[i] if i < len(visible) else str(i) for i in mine)


def _note_earlier_redis_dir(config: UpConfig) -> None:
    """Logs where the data of an `up` from before each port had its own Redis directory is,
    when this stack starts a new directory beside it."""
    earlier = Path(EARLIER_REDIS_DIR).absolute()
    if config.redis_dir != UpConfig.redis_dir or config.redis_directory().exists():
        return
    if (earlier / "appendonly.aof").exists() or (earlier / "appendonlydir").exists():
        log.warning(
            "starting a new Redis in %s; the data of an earlier `pagedserve up` is in %s "
            "(pass --redis-dir %s to serve from it)",
            config.redis_directory(),
            earlier,
            EARLIER_REDIS_DIR,
        )


def _ready(check: Callable[[], object]) -> Callable[[], str | None]:
    """A ``pagedserve.probe`` check as a ``Supervisor.wait_until`` probe."""
    from pagedserve.probe import ProbeFailed

    def probe() -> str | None:
        try:
            check()
        except ProbeFailed as err:
            return str(err)
        return None

    return probe


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _banner(config: UpConfig, url: str, redis_url: str, token: str, ids: list[str]) -> str:
    from pagedserve.redis_server import redact

    model = GatewayConfig(model=config.model).model_name()
    question = '{"role": "user", "content": "What is the capital of France?"}'
    body = f'{{"model": "{model}", "messages": [{question}], "max_tokens": 32, "temperature": 0'
    body += ', "stream": true}'  # greedy: a small model's sampled text wanders (temperature 1)
    redis_dir = config.redis_directory()
    redis_note = "external, not restarted" if os.environ.get("REDIS_URL") else f"in {redis_dir}"
    dp = config.data_parallel_size
    pools = f" on {dp} pools" if dp > 1 else ""
    return (
        f"pagedserve is up at {url} (redis {redact(redis_url)}, "
        f"kvstore {config.kvstore_endpoint()}, "
        f"{len(ids)} worker(s){pools}, {config.gateway_processes()} gateway process(es)). "
        "Ctrl-C stops it.\n"
        f"admin token ({ADMIN_TOKEN_ENV}): {token}\n"
        f"try: curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{body}'\n"
        f"supervised: a child that exits is restarted (backoff {config.restart_backoff_s:g} s "
        f"doubling to 30 s, at most {config.max_restarts} times in a row); workers keep their "
        f"ids ({', '.join(ids)}); redis: {redis_note}"
    )
