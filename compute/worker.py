"""``pagedserve compute``: a compute worker process (model + engine loop)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from compute.batch.scheduler import SchedulerConfig
from compute.loop.backoff import retry_with_backoff
from compute.parallel import ALL_REDUCES
from contracts import options
from contracts.heap import tune_gc_for_serving
from contracts.options import flag
from contracts.queue_keys import check_node

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from compute.loop.engine import Engine
    from compute.loop.rank import Group
    from compute.model.profile import Profiles
    from kvstore.client import KVClient
    from kvstore.protocol import ProfileOrigin

log = logging.getLogger("pagedserve.compute")


@dataclass(frozen=True)
class ComputeConfig:
    model: str = options.model("; must match the kvstore's --model")
    dtype: str = options.dtype(
        "model dtype; 'auto' takes the checkpoint's (must match the kvstore's pool)"
    )
    device: str = options.device(
        "'cuda', 'cuda:N', 'cpu' or 'auto' (the kvstore's pool must live there too)"
    )
    kvstore: str = options.kvstore()
    redis_url: str = options.redis_url()
    claim_idle_ms: int = flag(
        0,
        "a request whose worker has not renewed its claim this long is taken "
        "over by another worker (live workers renew every quarter of it); 0: the kvstore's "
        "--lease-timeout-s, when it declares the worker dead and lets others adopt its "
        "requests' blocks",
    )
    worker_id: str = flag(
        "",
        "name in the kvstore and the Redis consumer group (default: host-pid)",
    )
    pool: int = flag(
        0,
        "the kvstore's pool (GPU) this worker runs on, of its --data-parallel-size; it reads "
        "that pool's request stream. On CUDA, --device must be the pool's GPU (pool i: cuda:i)",
    )
    node: str = flag(
        "",
        "the host this worker's kvstore serves, when several hosts share one Redis (one "
        "gateway routes across them with --nodes NAME=ENDPOINT): its request streams are "
        "pagedserve:requests:NODE:POOL; empty: the first (or only) host",
    )
    cuda_graph_max_batch: int = flag(
        256,
        "on CUDA, capture decode steps of up to this many requests as CUDA graphs "
        "at startup (capped by --max-num-seqs); 0 runs every step eagerly",
    )
    cuda_graph_max_tokens: int = flag(
        2048,
        "on CUDA (Llama, Mistral, Qwen2, Qwen3 models), capture the forwards of "
        "other steps (prompt chunks beside decodes) of up to this many tokens as CUDA "
        "graphs of the whole decoder, one per token bucket (capped by "
        "--max-num-batched-tokens); 0 runs "
        "them eagerly",
    )
    profile_budget_s: float = flag(
        10.0,
        "seconds the worker may spend at start-up timing forwards for the kvstore's "
        "cost model (swap vs recompute), cheapest first; the kvstore extrapolates past the "
        "points left out. 0: time none (a cached profile is still used; without one the "
        "kvstore prefers swapping and loading, which it measures itself)",
    )
    profile_cache: str = flag(
        "",
        "directory where measured profiles are kept and reused by a worker of the "
        "same model files, device, dtype, code version and graph settings (a restart then "
        "measures nothing, unless its budget is larger than the one that left points out); "
        "'' is $PAGEDSERVE_PROFILE_CACHE, else "
        "$XDG_CACHE_HOME/pagedserve/profiles (~/.cache/...); 'off': no cache",
    )
    tensor_parallel_size: int = flag(
        1,
        "ranks of this worker's tensor-parallel group: this process is rank 0 (the kvstore, "
        "Redis, the scheduling) and starts ranks 1 to N-1 (python -m compute.loop.rank), rank r "
        "on the r-th GPU after --device (on CPU all on the CPU, over gloo); each loads only its "
        "shards of the safetensors checkpoint. The kvstore needs the same "
        "--tensor-parallel-size. Every rank captures the same CUDA graphs and runs the "
        "forwards rank 0 times for the cost-model profile",
    )
    tp_all_reduce: str = flag(
        "auto",
        "the all-reduces of a tensor-parallel group on CUDA: 'auto' sums activations of up to "
        "4 MiB (decode steps, short chunks) in one kernel over NVLink (PyTorch's symmetric "
        "memory, when every GPU of the group has it) and larger ones with NCCL; 'nccl': NCCL "
        "does all of them",
        choices=ALL_REDUCES,
    )
    log_level: str = options.log_level()

    def __post_init__(self) -> None:
        if self.node:
            check_node(self.node)  # ValueError: one line at the command line
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: at least 1")


class Phases:
    """Start-up phases and their seconds, in order, for one log line; the first, ``python``, is
    the time from the process's start (the interpreter, the command line's imports) to now."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._at = time.perf_counter()
        started = _process_age_s()
        if started is not None:
            self.seconds["python"] = started

    def done(self, name: str) -> None:
        """Phase ``name`` ended now: it took the time since the previous one ended."""
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._at
        self._at = now

    def split(self, name: str, parts: dict[str, float]) -> None:
        """Phase ``name`` held ``parts`` (seconds): shown apart, the rest under ``name``."""
        total = self.seconds.pop(name, 0.0)
        self.seconds[name] = max(total - sum(parts.values()), 0.0)
        self.seconds.update(parts)

    def line(self, notes: dict[str, str]) -> str:
        total = sum(self.seconds.values())
        parts = [
            f"{name} {s:.1f} s" + (f" ({notes[name]})" if name in notes else "")
            for name, s in self.seconds.items()
        ]
        return f"{', '.join(parts)}; {total:.1f} s in all"


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux ``/proc``; None elsewhere)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def run(config: ComputeConfig, scheduling: SchedulerConfig) -> None:
    """Loads the model (progress logged), takes its cost-model profile (cached, or measured
    within the budget), registers and serves until a signal: the first drains the running
    requests, a second stops at once. Logs the start-up's phases in one line."""
    options.configure_logging(config.log_level)
    phases = Phases()
    from compute.model.models import load_model
    from compute.model.profile_cache import obtain
    from contracts.model_config import resolve_device
    from kvstore.client import KVClient

    phases.done("imports")
    worker_id = config.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    device = resolve_device(config.device)
    group = None
    if config.tensor_parallel_size > 1:
        from compute.loop.rank import start_group
        from compute.model.models import load_sharded_model

        group = start_group(
            config.model,
            config.dtype,
            device,
            config.tensor_parallel_size,
            config.tp_all_reduce,
            config.log_level,
        )
        model, tokenizer = load_sharded_model(config.model, config.dtype, device, group.group)
    else:
        model, tokenizer = load_model(config.model, config.dtype, device)
    phases.done("model")
    graph_tokens = min(config.cuda_graph_max_tokens, scheduling.max_num_batched_tokens)
    profiles, origin = obtain(
        config.model,
        model,
        16,
        graph_tokens,
        config.profile_budget_s,
        config.profile_cache,
        group.group if group is not None else None,
    )
    phases.done("profile")
    r = redis.Redis.from_url(config.redis_url)
    signals: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: signals.append(signum))
    signal.signal(signal.SIGTERM, lambda signum, _frame: signals.append(signum))
    with KVClient(config.kvstore) as kv, contextlib.ExitStack() as stack:
        engine = _start_engine(
            worker_id, model, tokenizer, kv, r, config, scheduling, profiles, origin, signals, group
        )
        if group is not None:
            stack.callback(stop_group, group, engine)
        if engine is None:
            return
        phases.done("register")
        if engine.runner is not None:
            phases.split("register", engine.runner.startup_s)
        tune_gc_for_serving()
        phases.done("gc")
        cut = f", {origin.skipped} points past its budget" if origin.skipped else ""
        log.info("start-up phases: %s", phases.line({"profile": origin.source + cut}))
        log.info(
            "worker %s serving (redis %s, kvstore %s)", worker_id, config.redis_url, config.kvstore
        )
        engine.run_forever(signals)
    log.info("worker %s stopped; computed %d tokens", worker_id, engine.tokens_computed)


def stop_group(group: Group, engine: Engine | None) -> None:
    """The other ranks stop with rank 0 (its runner, the last it built, sends them ``stop``)."""
    group.stop(engine.runner if engine is not None else None)


def _start_engine(
    worker_id: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    kv: KVClient,
    r: redis.Redis,
    config: ComputeConfig,
    scheduling: SchedulerConfig,
    profiles: Profiles,
    origin: ProfileOrigin,
    signals: list[int],
    group: Group | None = None,
) -> Engine | None:
    """The engine, once the kvstore and Redis answer (retried with backoff; None if a signal
    came first)."""
    from compute.loop.engine import RECOVERABLE, RETRY_MAX_S, Engine

    def start() -> Engine:
        return Engine(
            worker_id,
            model,
            tokenizer,
            kv,
            r,
            scheduling,
            profiles.prefill,
            config.claim_idle_ms,
            config.cuda_graph_max_batch,
            config.cuda_graph_max_tokens,
            profiles.recompute,
            origin,
            heartbeat=True,
            pool=config.pool,
            node=config.node,
            group=group.group if group is not None else None,
        )

    return retry_with_backoff(
        start, lambda: bool(signals), RECOVERABLE, RETRY_MAX_S, "cannot start serving yet"
    )
