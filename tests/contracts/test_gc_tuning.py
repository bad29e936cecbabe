"""``contracts.heap.tune_gc_for_serving``, in a fresh interpreter (it freezes the heap of the
process that calls it, for good), and in the services that call it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import start_kvstore, stop_process

PROBE = textwrap.dedent(
    """
    import gc, weakref
    from contracts.heap import YOUNG_COLLECTION_EVERY, tune_gc_for_serving

    class Node:
        pass

    kept = Node()  # lives as long as the process
    garbage = Node()
    garbage.self = garbage  # a cycle: only a collection frees it
    freed = []
    weakref.finalize(garbage, freed.append, True)
    del garbage
    frozen = tune_gc_for_serving()
    assert freed == [True], "start-up garbage is collected before the freeze"
    assert frozen == gc.get_freeze_count() > 1000, frozen  # the imports' objects too
    assert not any(o is kept for o in gc.get_objects()), "frozen: no collection traverses it"
    assert gc.get_threshold()[0] == YOUNG_COLLECTION_EVERY
    after = Node()
    assert any(o is after for o in gc.get_objects()), "later objects are collected as before"
    print("ok")
    """
)


def test_start_up_objects_are_frozen_and_garbage_collected_first() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_kvstore_tunes_its_collector_before_serving() -> None:
    process, _ = start_kvstore("--model", "tiny", "--dtype", "float32")
    log = stop_process(process)
    assert "garbage collector:" in log and "start-up objects frozen" in log, log[-2000:]
