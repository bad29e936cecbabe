"""``pagedserve compute``: a compute worker process (model + engine loop)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis

from compute.scheduler import SchedulerConfig
from contracts.endpoints import DEFAULT_ENDPOINT
from contracts.heap import tune_gc_for_serving

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from compute.engine import Engine
    from compute.profile import RecomputeProfile
    from kvstore.client import KVClient

log = logging.getLogger("pagedserve.compute")


@dataclass(frozen=True)
class ComputeConfig:
    model: str = field(
        default="tiny",
        metadata={
            "help": "local Hugging Face checkpoint directory, or 'tiny' (random weights, byte "
            "tokenizer); must match the kvstore's --model"
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "model dtype; 'auto' takes the checkpoint's (must match the kvstore's pool)",
            "choices": ["auto", "float32", "float16", "bfloat16"],
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "help": "'cuda', 'cuda:N', 'cpu' or 'auto' (the kvstore's pool must live there too)"
        },
    )
    kvstore: str = field(default=DEFAULT_ENDPOINT, metadata={"help": "the kvstore's endpoint"})
    redis_url: str = field(
        default="redis://127.0.0.1:6379/0",
        metadata={"help": "Redis holding the request queue and output streams"},
    )
    claim_idle_ms: int = field(
        default=0,
        metadata={
            "help": "a request whose worker has not renewed its claim this long is taken "
            "over by another worker (live workers renew every quarter of it); 0: the kvstore's "
            "--lease-timeout-s, when it declares the worker dead and lets others adopt its "
            "requests' blocks"
        },
    )
    worker_id: str = field(
        default="",
        metadata={"help": "name in the kvstore and the Redis consumer group (default: host-pid)"},
    )
    cuda_graph_max_batch: int = field(
        default=256,
        metadata={
            "help": "on CUDA, capture decode steps of up to this many requests as CUDA graphs "
            "at startup (capped by --max-num-seqs); 0 runs every step eagerly"
        },
    )
    cuda_graph_max_tokens: int = field(
        default=2048,
        metadata={
            "help": "on CUDA (Llama, Mistral, Qwen2, Qwen3 models), capture the forwards of "
            "other steps (prompt chunks beside decodes) of up to this many tokens as CUDA "
            "graphs of the whole decoder, one per token bucket (capped by "
            "--max-num-batched-tokens); 0 runs "
            "them eagerly"
        },
    )
    log_level: str = field(default="INFO", metadata={"help": "logging level"})


def run(config: ComputeConfig, scheduling: SchedulerConfig) -> None:
    """Loads the model (progress logged), measures its prefill times, registers and serves
    until a signal: the first drains the running requests, a second stops at once."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from compute.models import load_model
    from compute.profile import measure_prefill, measure_recompute
    from contracts.model_config import resolve_device
    from kvstore.client import KVClient

    worker_id = config.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    model, tokenizer = load_model(config.model, config.dtype, resolve_device(config.device))
    log.info("measuring prefill times for the kvstore's cost model")
    profile = measure_prefill(model, block_size=16)
    graph_tokens = min(config.cuda_graph_max_tokens, scheduling.max_num_batched_tokens)
    recompute = measure_recompute(model, block_size=16, graph_tokens=graph_tokens)
    r = redis.Redis.from_url(config.redis_url)
    signals: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: signals.append(signum))
    signal.signal(signal.SIGTERM, lambda signum, _frame: signals.append(signum))
    with KVClient(config.kvstore) as kv:
        engine = _start_engine(
            worker_id, model, tokenizer, kv, r, config, scheduling, profile, recompute, signals
        )
        if engine is None:
            return
        tune_gc_for_serving()
        log.info(
            "worker %s serving (redis %s, kvstore %s)", worker_id, config.redis_url, config.kvstore
        )
        engine.run_forever(signals)
    log.info("worker %s stopped; computed %d tokens", worker_id, engine.tokens_computed)


def _start_engine(
    worker_id: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    kv: KVClient,
    r: redis.Redis,
    config: ComputeConfig,
    scheduling: SchedulerConfig,
    profile: list[tuple[int, float]],
    recompute: RecomputeProfile,
    signals: list[int],
) -> Engine | None:
    """The engine, once the kvstore and Redis answer (retried with backoff; None if a signal
    came first)."""
    from compute.engine import RECOVERABLE, RETRY_MAX_S, Engine

    delay = 0.25
    while not signals:
        try:
            return Engine(
                worker_id,
                model,
                tokenizer,
                kv,
                r,
                scheduling,
                profile,
                config.claim_idle_ms,
                config.cuda_graph_max_batch,
                config.cuda_graph_max_tokens,
                recompute,
            )
        except RECOVERABLE as err:
            log.warning("cannot start serving yet (%s): retrying in %.1f s", err, delay)
            time.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)
    return None
