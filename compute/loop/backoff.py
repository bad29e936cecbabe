"""Retrying with backoff until an attempt works or the caller stops: how a worker waits for the
kvstore and Redis at startup (``compute.worker``) and after losing them (``Engine.recover``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger("pagedserve.compute")
FIRST_DELAY_S = 0.25


def retry_with_backoff(
    attempt: Callable[[], T],
    stop: Callable[[], bool],
    errors: tuple[type[Exception], ...],
    max_delay_s: float,
    message: str,
    no_wait: tuple[type[Exception], ...] = (),
) -> T | None:
    """``attempt()``'s result, calling it again after each of ``errors`` (logged as ``message``
    and the error) once a delay has passed: ``FIRST_DELAY_S``, doubled each time, at most
    ``max_delay_s``; no delay after one of ``no_wait`` (an error that has waited already). None
    once ``stop()`` says so, checked before each attempt."""
    delay = FIRST_DELAY_S
    while not stop():
        try:
            return attempt()
        except errors as err:
            wait = 0.0 if isinstance(err, no_wait) else delay
            log.warning("%s (%s): retrying in %.1f s", message, err, wait)
            time.sleep(wait)
            delay = min(2 * delay, max_delay_s)
    return None
