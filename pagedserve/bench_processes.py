"""``pagedserve bench --processes N``: the same seeded requests sent by N client OS processes,
reported as if one client had sent them (one Python client can be the bottleneck at tens of
thousands of streamed tokens per second).

Each process (``multiprocessing``, "spawn") builds the very request list the parent built (same
flags, same seed) and takes the groups (requests, or conversations) ``i`` with ``i % N`` its own
index. Once every process has its session (and the model) ready, the parent picks a start instant
a moment ahead; each process sleeps until then and measures its times from it, so all the
processes share one clock zero. A group is sent at its arrival time on the one global
``--request-rate`` schedule (the draws a single client makes); ``--max-concurrency`` is shared out
(the first ``max_concurrency % N`` processes get one more). Each process writes its results,
plain JSON, to a file of a temporary directory; the parent puts them back in the order of the
groups, so ``summarize`` sees what a single client would have: durations from the common start to
the last answer, percentiles over every request. Progress: the parent's line, from counters the
processes share. Ctrl-C: the processes (which ignore SIGINT) are terminated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import multiprocessing
import random
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

import aiohttp

from contracts.heap import tune_gc_for_serving
from pagedserve.bench_config import BenchConfig
from pagedserve.bench_report import Result
from pagedserve.bench_workloads import Turn

START_AHEAD_S = 0.05  # from the last process being ready to the common start
POLL_S = 0.005
PROCESS_HEADER = "X-Bench-Process"  # which client process sent a request (its index)


@dataclass(frozen=True)
class Shared:
    """What the parent and its processes share: processes ready, the start instant (wall clock,
    0 until set), requests finished and their output tokens."""

    ready: Synchronized[int]
    start_at: Synchronized[float]
    done: Synchronized[int]
    tokens: Synchronized[int]


def arrivals(config: BenchConfig, count: int) -> list[float]:
    """Each group's send time, seconds after the start: the Poisson schedule a single client
    draws (``random.Random(seed + 1)``, one gap after each group), or all at 0."""
    if not math.isfinite(config.request_rate):
        return [0.0] * count
    rng, at, times = random.Random(config.seed + 1), 0.0, []
    for _ in range(count):
        times.append(at)
        at += rng.expovariate(config.request_rate)
    return times


def concurrency_share(max_concurrency: int, processes: int, index: int) -> int:
    """Process ``index``'s part of ``--max-concurrency`` (0, no limit, stays 0); parts add up."""
    if not max_concurrency:
        return 0
    return max_concurrency // processes + int(index < max_concurrency % processes)


def run_processes(config: BenchConfig, groups: list[list[Turn]]) -> tuple[list[Result], float]:
    """Sends ``groups`` from ``config.processes`` processes; the results in the order of the
    groups (as ``bench.run_requests``) and the duration from the start to the last answer."""
    from pagedserve.bench import Progress

    ctx = multiprocessing.get_context("spawn")
    shared = Shared(ctx.Value("q", 0), ctx.Value("d", 0.0), ctx.Value("q", 0), ctx.Value("q", 0))
    n, total = config.processes, sum(len(g) for g in groups)
    progress = Progress(total, config.progress)
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-") as tmp:
        paths = [Path(tmp) / f"process-{i}.json" for i in range(n)]
        config_json = json.dumps(asdict(config))
        processes = [
            ctx.Process(
                target=child,
                args=(config_json, i, shared, str(paths[i])),
                name=f"pagedserve-bench-{i}",
                daemon=True,
            )
            for i in range(n)
        ]
        try:
            for process in processes:
                process.start()
            while shared.ready.value < n:
                _check(processes)
                time.sleep(POLL_S)
            shared.start_at.value = time.time() + START_AHEAD_S
            shown = -1
            while any(p.is_alive() for p in processes):
                _check(processes)
                if shared.done.value != shown:
                    shown = shared.done.value
                    progress.update(shown, shared.tokens.value, time.time() - shared.start_at.value)
                time.sleep(0.1)
            _check(processes)
            if shared.done.value != shown:
                progress.update(
                    shared.done.value, shared.tokens.value, time.time() - shared.start_at.value
                )
        finally:
            for process in processes:
                if process.is_alive():
                    process.terminate()
            for process in processes:
                process.join()
        progress.close()
        by_group: dict[int, list[Result]] = {}
        for path in paths:
            for index, rows in json.loads(path.read_text()):
                by_group[int(index)] = [Result(**row) for row in rows]
    results = [r for i in range(len(groups)) for r in by_group.get(i, [])]
    return results, max((r.end for r in results), default=0.0)


def _check(processes: Sequence[BaseProcess]) -> None:
    """Raises SystemExit when a process failed (it said why on stderr)."""
    for i, process in enumerate(processes):
        if process.exitcode not in (None, 0):
            raise SystemExit(f"pagedserve bench: client process {i} failed ({process.exitcode})")


def child(config_json: str, index: int, shared: Shared, out: str) -> None:
    """A client process: sends its share of the groups, writes ``[[group, [result...]]...]``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent terminates it
    config = BenchConfig(**json.loads(config_json))
    from pagedserve.bench import requests_of

    groups = requests_of(config)
    times = arrivals(config, len(groups))
    mine = [(i, groups[i], times[i]) for i in range(index, len(groups), config.processes)]
    share = concurrency_share(config.max_concurrency, config.processes, index)
    config = dataclasses.replace(config, max_concurrency=share)
    tune_gc_for_serving()
    try:
        sent = asyncio.run(_send(config, index, mine, shared))
    except aiohttp.ClientError as err:
        print(f"pagedserve bench: {config.base_url}: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    rows = [[i, [asdict(r) for r in results]] for i, results in sent]
    Path(out).write_text(json.dumps(rows))


async def _send(
    config: BenchConfig, index: int, mine: list[tuple[int, list[Turn], float]], shared: Shared
) -> list[tuple[int, list[Result]]]:
    from pagedserve.bench import Client, first_model

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = config.model or await first_model(session, config)
        client = Client(config, session, model)
        client.headers[PROCESS_HEADER] = str(index)
        with shared.ready.get_lock():
            shared.ready.value += 1
        while not shared.start_at.value:
            await asyncio.sleep(POLL_S)
        start_at = shared.start_at.value
        await asyncio.sleep(max(0.0, start_at - time.time()))
        client.t0 = time.perf_counter() - (time.time() - start_at)  # the common clock zero

        def done(result: Result) -> None:
            with shared.done.get_lock():
                shared.done.value += 1
            with shared.tokens.get_lock():
                shared.tokens.value += result.output_tokens

        async def one(i: int, group: list[Turn], at: float) -> tuple[int, list[Result]]:
            await asyncio.sleep(max(0.0, at - client.now()))
            return i, await client.conversation(group, done)

        return list(await asyncio.gather(*(one(i, g, at) for i, g, at in mine)))
