"""The options the processes of a stack share, declared once: each function is the ``field`` of a
frozen config dataclass (``kvstore.daemon.KVStoreConfig``, ``compute.worker.ComputeConfig``,
``gateway.config.GatewayConfig``, ``pagedserve.up.UpConfig``), which ``pagedserve.config`` turns
into the same ``--flag`` in every command. What differs between the processes (the help's note on
what the option means to that one) is an argument.

Here, not in the CLI package, because every service imports it and no service may import
``pagedserve``.
"""

from __future__ import annotations

import logging
from dataclasses import field
from typing import TypeVar

from contracts.checkpoints import MODEL_HELP
from contracts.endpoints import DEFAULT_ENDPOINT

DTYPES = ["auto", "float32", "float16", "bfloat16"]
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
T = TypeVar("T")


def flag(default: T, help_text: str, **more: object) -> T:
    """A config field: its default and its ``--help`` text (``more``: other metadata
    ``pagedserve.config`` reads, e.g. ``choices``)."""
    return field(default=default, metadata={"help": help_text, **more})


def model(note: str, default: str = "tiny") -> str:
    """``--model``: ``MODEL_HELP`` followed by ``note`` (e.g. ``"; must match the workers'"``)."""
    return flag(default, f"{MODEL_HELP}{note}")


def dtype(help_text: str) -> str:
    """``--dtype``: one of ``DTYPES``, 'auto' by default."""
    return flag("auto", help_text, choices=DTYPES)


def device(help_text: str) -> str:
    """``--device``: 'cuda', 'cuda:N', 'cpu' or 'auto' (the default)."""
    return flag("auto", help_text)


def kvstore(help_text: str = "the kvstore's endpoint") -> str:
    """``--kvstore``: the endpoint a client of the kvstore connects to."""
    return flag(DEFAULT_ENDPOINT, help_text)


def redis_url() -> str:
    """``--redis-url``: the Redis of the request queue."""
    return flag(DEFAULT_REDIS_URL, "Redis holding the request queue and output streams")


def log_level() -> str:
    """``--log-level``: a ``logging`` level name, case-insensitive."""
    return flag("INFO", "logging level")


def configure_logging(level: str) -> None:
    """The root logger of a service process, at ``--log-level``."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
