"""Per-request fault isolation: an exception raised on behalf of one request ends that request
alone, never the worker.

Everything the worker does for one request (its admission and adoption, a guide's compilation
and its matcher's advance, its penalties and logit bias, logprobs, detokenization and stop
strings, beam scoring, forks, output records) runs inside ``Faults.guard(req_id, stage)``. An
exception there is logged once with its traceback and the request's id and stage, the request is
marked failed (``Fault``: a message naming the cause, and whose fault it is: ``RequestError``'s
code when the cause lies in the request, else "worker_error"), and the code after the boundary
goes on for every other request; the engine then ends each failed request (an error record, its
blocks freed: ``Session.end_faults``).

Two kinds of exception pass through a boundary and are not a request's:
- a fault of the device (a CUDA error, an out-of-memory error): the device, and with it every
  request's KV and the captured graphs, is in an unknown state, so the process ends (its
  supervisor restarts it, and its requests are taken over from Redis and the kvstore, at most
  ``queue_keys.MAX_DELIVERIES`` times each);
- what the engine recovers from as a whole, the kvstore or Redis away (``passthrough``: the
  engine's ``RECOVERABLE``).
Batched work on the device (the forward, the penalties' and the draw's tensor operations) is the
engine's, not a request's: what a request gives it (token ids, logit bias, stop ids) is checked
against the model when the request is admitted (``compute.batch.admission``), so it cannot fail
there because of one request.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from contracts.records import ErrorCode

__all__ = ["Fault", "Faults", "RequestError", "is_device_fault"]

log = logging.getLogger("pagedserve.compute")


class RequestError(Exception):
    """The request asks for what this worker cannot do, by its own fault: ended with ``code``
    (the gateway answers a 400)."""

    def __init__(self, message: str, code: ErrorCode = "invalid_request") -> None:
        super().__init__(message)
        self.code: ErrorCode = code


@dataclass(frozen=True)
class Fault:
    """Why a request failed: the stage that raised, a message for the client, whose fault."""

    req_id: str
    stage: str
    message: str
    code: ErrorCode


def is_device_fault(err: BaseException) -> bool:
    """Whether ``err`` leaves the device (and so every request on it) in an unknown state."""
    if isinstance(err, MemoryError | torch.OutOfMemoryError | torch.AcceleratorError):
        return True
    return isinstance(err, RuntimeError) and "CUDA error" in str(err)  # raised by a library


class Faults:
    """The requests whose per-request work raised since ``take`` last ran: one per engine
    session, written only inside its ``guard``s."""

    def __init__(self, passthrough: tuple[type[BaseException], ...] = ()) -> None:
        self._passthrough = passthrough
        self._failed: dict[str, Fault] = {}

    @contextlib.contextmanager
    def guard(self, req_id: str, stage: str) -> Iterator[None]:
        """Runs the block on behalf of request ``req_id``; an exception there (but a device
        fault or a ``passthrough`` one) marks the request failed and ends the block only."""
        try:
            yield
        except Exception as err:
            self.record(req_id, stage, err)

    def record(self, req_id: str, stage: str, err: Exception) -> None:
        """``err`` was raised on behalf of request ``req_id`` while ``stage``: marks the
        request failed, or raises ``err`` again if it is not the request's (a device fault, a
        ``passthrough`` one). For hot loops, where a ``try`` costs nothing and a ``with`` does:
        ``except Exception as err: faults.record(...)``."""
        if isinstance(err, self._passthrough) or is_device_fault(err):
            raise err
        if req_id in self._failed:  # its first fault is the one to tell
            return
        if isinstance(err, RequestError):
            log.warning("request %s refused while %s: %s", req_id, stage, err)
            self._failed[req_id] = Fault(req_id, stage, str(err), err.code)
            return
        log.error("request %s failed while %s; the others go on", req_id, stage, exc_info=err)
        where = traceback.extract_tb(err.__traceback__)[-1].name
        message = f"the worker failed while {stage} ({type(err).__name__} in {where}: {err})"
        self._failed[req_id] = Fault(req_id, stage, message, "worker_error")

    def failed(self, req_id: str) -> bool:
        """Whether ``req_id`` failed (the rest of its work in this step is skipped)."""
        return req_id in self._failed

    def take(self) -> list[Fault]:
        """The faults since the last call, in the order they happened; forgets them."""
        faults, self._failed = list(self._failed.values()), {}
        return faults

    def pop(self, req_id: str) -> Fault | None:
        """The fault of ``req_id``, if it failed; forgets it."""
        return self._failed.pop(req_id, None)
