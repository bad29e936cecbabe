"""A garbage-collection probe for any pagedserve process: put this directory first on
PYTHONPATH and every Python process started with it (the gateway, the kvstore, a worker, the
benchmark client) times its collections and writes, at exit, one file
``$GC_PROBE_DIR/gc-<pid>.txt`` (default /tmp): its command line, then per phase ("startup"
until ``contracts.heap.tune_gc_for_serving`` runs, "serving" after) and generation the count,
total and longest collection. ``GC_PROBE_UNTUNED=1`` makes ``tune_gc_for_serving`` mark the
phase only (no freeze, thresholds unchanged): the untuned behaviour, measured the same way.

    PYTHONPATH=bench/gc_probe python bench/gateway_throughput.py --requests 1000 --tokens 200
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
from typing import Any

_started: dict[int, float] = {}
_stats: dict[tuple[str, int], list[float]] = {}  # (phase, generation) -> [count, total, max]
_phase = ["startup"]
_UNTUNED = bool(os.environ.get("GC_PROBE_UNTUNED"))
_freeze, _set_threshold = gc.freeze, gc.set_threshold


def _time(phase: str, info: dict[str, Any]) -> None:
    generation = info["generation"]
    if phase == "start":
        _started[generation] = time.perf_counter()
        return
    took = time.perf_counter() - _started.pop(generation, time.perf_counter())
    stat = _stats.setdefault((_phase[0], generation), [0, 0.0, 0.0])
    stat[0] += 1
    stat[1] += took
    stat[2] = max(stat[2], took)


def _serving_freeze() -> None:
    _phase[0] = "serving"
    if not _UNTUNED:
        _freeze()


def _serving_threshold(*thresholds: int) -> None:
    if not _UNTUNED:
        _set_threshold(*thresholds)


def _write() -> None:
    path = os.path.join(os.environ.get("GC_PROBE_DIR", "/tmp"), f"gc-{os.getpid()}.txt")
    with open(path, "w") as out:
        out.write(" ".join(sys.argv)[:300] + "\n")
        for (phase, generation), (count, total, longest) in sorted(_stats.items()):
            out.write(
                f"{phase} gen{generation}: {int(count)} collections, {total * 1e3:.1f} ms, "
                f"longest {longest * 1e3:.1f} ms\n"
            )


gc.callbacks.append(_time)
gc.freeze = _serving_freeze
gc.set_threshold = _serving_threshold
atexit.register(_write)
