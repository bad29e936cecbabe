"""The garbage collector of a long-lived service process (``tune_gc_for_serving``).

CPython's full collections traverse every tracked object. A service's heap is mostly what its
start-up made and keeps for life (imported modules, torch and transformers, the tokenizer, the
model's modules), and under traffic each full collection walked those hundreds of thousands of
objects again. Its young collections ran every 700 allocations, so short-lived per-token
objects (a gateway's deltas waiting for their stream) were promoted and soon paid for in full
collections. Measured on a gateway streaming to 1,000 clients on the 2-core development VM
(``bench/gateway_throughput.py``, BENCHMARKS-archive.md, issue 11, tenth pass): 12 full collections
took 3.1-3.3 s while its timed run used 6.8-7.4 s of CPU, the longest stalling every stream
for ~300 ms; tuned, its collections took 0.06-0.10 s. A CPU worker serving 1,000 requests ran
6 full collections (1.2 s, up to 219 ms each); tuned, one young one.
"""

from __future__ import annotations

import atexit
import gc
import logging

__all__ = ["YOUNG_COLLECTION_EVERY", "tune_gc_for_serving"]

log = logging.getLogger(__name__)

YOUNG_COLLECTION_EVERY = 30_000  # allocations between young collections (CPython's default: 700)


def tune_gc_for_serving() -> int:
    """Collects what start-up left as garbage, moves every object alive now into the
    collector's permanent generation (``gc.freeze``: no collection traverses it again, and
    nothing frozen is freed before exit), and runs young collections every
    ``YOUNG_COLLECTION_EVERY`` allocations. Call once per process, when start-up is done and
    before serving. Logs and returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # so leak checks at exit (nanobind's) see the heap freed
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, older, oldest)
    frozen = gc.get_freeze_count()
    log.info(
        "garbage collector: %d start-up objects frozen, young collections every %d allocations",
        frozen,
        YOUNG_COLLECTION_EVERY,
    )
    return frozen
