"""``pagedserve bench``'s entry: the requests built, sent from one process (``pagedserve.bench``)
or several (``--processes``: ``pagedserve.bench_processes``), the report printed and written."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from contracts.heap import tune_gc_for_serving
from pagedserve.bench import requests_of, run_requests
from pagedserve.bench_config import BenchConfig
from pagedserve.bench_processes import run_processes
from pagedserve.bench_report import report, summarize


def run(config: BenchConfig) -> dict[str, Any]:
    """``pagedserve bench``: sends the workload, prints the report; the summary."""
    try:
        groups = requests_of(config)
    except (ValueError, OSError) as err:
        raise SystemExit(f"pagedserve bench: {err}") from None
    if config.processes < 1:
        raise SystemExit("pagedserve bench: --processes must be at least 1")
    if 0 < config.max_concurrency < config.processes:
        raise SystemExit("pagedserve bench: --processes must not exceed --max-concurrency")
    tune_gc_for_serving()  # a full collection's pause would count as the server's latency
    try:
        if config.processes > 1:
            results, duration = run_processes(config, groups)
        else:
            results, duration = asyncio.run(run_requests(config, groups))
    except aiohttp.ClientError as err:
        raise SystemExit(f"pagedserve bench: {config.base_url}: {err}") from None
    summary = summarize(config, results, duration)
    print(report(summary), flush=True)
    if config.result_json:
        with open(config.result_json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary
