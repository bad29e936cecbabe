"""A real `pagedserve compute` process with faults injected into every per-request stage, for the
fault-isolation tests: ``python -m tests.compute.faulty_worker <pagedserve compute flags>``.

Each stage's function is wrapped (monkeypatched in this process only): when it runs for a marked
request it raises ``InjectedFault`` (a request whose id contains ``poison-{stage}``), or kills the
process as a crash would (``kill-{stage}``, or any request with ``seed`` = ``KILL_SEED``, which a
client of the gateway can set). A request with ``seed`` = ``SLOW_SEED`` makes the step that draws
its first token last ``SLOW_S``. Stages whose function has no request id at hand mark the request
by a parameter instead: a guide whose spec contains ``poison-guide``, a stop string
``poison-stop``, ``logprobs`` = ``POISON_LOGPROBS``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import compute.batch.beams
import compute.batch.logprobs
import compute.batch.registry
import compute.batch.requests
import compute.loop.model_step
import compute.sampling.grammar
import compute.sampling.stops
from pagedserve.cli import main

POISON_LOGPROBS = 17  # a request asking for this many top logprobs fails where they are built
KILL_SEED = 666_666  # a request with this seed kills the worker when it is admitted
SLOW_SEED = 777_777  # a request with this seed makes the step that draws its first token slow
SLOW_S = 8.0  # how slow: longer than the tests' leases


class InjectedFault(RuntimeError):
    """Raised on purpose inside a per-request stage."""


def _id_marked(req_id: str, stage: str) -> bool:
    if f"kill-{stage}" in req_id:
        os.kill(os.getpid(), signal.SIGKILL)
    return f"poison-{stage}" in req_id


def _slow(seed: int | None, generated: int) -> bool:
    if seed == SLOW_SEED and generated == 0:
        time.sleep(SLOW_S)  # a long step: a long prompt chunk on a CPU, a graph capture
    return False


def _killer(seed: int | None) -> bool:
    if seed == KILL_SEED:
        os.kill(os.getpid(), signal.SIGKILL)
    return False


# stage -> (owner, attribute, whether a call is for a marked request)
STAGES: dict[str, tuple[Any, str, Callable[..., bool]]] = {
    "admission": (
        compute.batch.registry.Requests,
        "start",
        lambda self, entry_id, record: (
            _killer(record.params.seed) or _id_marked(record.req_id, "admission")
        ),
    ),
    "adoption": (
        compute.batch.registry.Requests,
        "resume_streamed",
        lambda self, entry_id, record, streamed: _id_marked(record.req_id, "adoption"),
    ),
    "guide": (
        compute.sampling.grammar.Grammars,
        "matcher",
        lambda self, guide: "poison-guide" in guide.spec,
    ),
    "grammar": (
        compute.batch.requests.Branch,
        "accept",
        lambda self, offset, token: _id_marked(self.seq.seq_id, "grammar"),
    ),
    "sampling": (
        compute.loop.model_step.ModelStep,
        "_rows",
        lambda self, i, chunk, active, branch, first: (
            _slow(active.record.params.seed, branch.seq.num_generated)
            or _id_marked(active.record.req_id, "sampling")
        ),
    ),
    "penalties": (
        compute.loop.model_step.ModelStep,
        "_processed_row",
        lambda self, row, chunk, *rest: _id_marked(chunk.seq.seq_id, "penalties"),
    ),
    "logprobs": (
        compute.batch.logprobs.Logprobs,
        "of",
        lambda self, row: row in self.rows and self.counts[self.rows.index(row)] == POISON_LOGPROBS,
    ),
    "prompt-logprobs": (
        compute.batch.logprobs.PromptLogprobs,
        "store",
        lambda self, i: _id_marked(self.owners[i].record.req_id, "prompt-logprobs"),
    ),
    "stop": (
        compute.sampling.stops.StopChecker,
        "append",
        lambda self, token, last=False: "poison-stop" in self._stops,
    ),
    "beams": (
        compute.batch.beams.BeamGroup,
        "advance",
        lambda self, scheduler: _id_marked(self._prefix, "beams"),
    ),
    "fork": (
        compute.batch.registry.Requests,
        "fork_branch",
        lambda self, active, index, first_token: _id_marked(active.record.req_id, "fork"),
    ),
    "output": (
        compute.loop.model_step,
        "output_record",
        lambda active, *rest, **kw: _id_marked(active.record.req_id, "output"),
    ),
}


def inject(stage: str, owner: Any, name: str, marked: Callable[..., bool]) -> None:
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if marked(*args, **kwargs):
            raise InjectedFault(f"injected fault at {stage}")
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


if __name__ == "__main__":
    for stage, (owner, name, marked) in STAGES.items():
        inject(stage, owner, name, marked)
    main(["compute", *sys.argv[1:]])
