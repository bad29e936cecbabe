"""Priority under overload, over HTTP with `pagedserve bench` (issue 37's goal: priority-0
requests' TTFT p99 within 2x of an unloaded server's, low-priority requests served later, none
dropped). One server (``pagedserve up``, the worker with ``--read-ahead``), the random mix
(prompts 64-1024 tokens, ``max_tokens`` 32-512), in one lease:

1. ``alone``: the priority-0 stream alone: ``--urgent`` requests, Poisson at ``--rate``/s;
2. ``overload``: ``--requests`` of priority ``--low`` sent at once, and the same priority-0
   stream started ``--after`` seconds later, beside it.

Prints each run's row (completed, output tok/s, TTFT p50/p99, ITL p50/p99) and the priority-0
TTFT p99 under overload against alone.

    python bench/priority.py --shape 8b [--requests 2000 --urgent 100 --rate 4 --read-ahead 256]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.http_serve import bench, pagedserve_up, row, warm_up  # noqa: E402
from bench.shapes import checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["1b", "8b"], default="8b")
    parser.add_argument("--requests", type=int, default=2000, help="low-priority, at once")
    parser.add_argument("--low", type=int, default=10, help="their priority")
    parser.add_argument("--urgent", type=int, default=100, help="priority-0 requests")
    parser.add_argument("--rate", type=float, default=4.0, help="priority-0 requests per second")
    parser.add_argument("--after", type=float, default=10.0, help="seconds into the overload")
    parser.add_argument("--read-ahead", type=int, default=256, help="the worker's --read-ahead")
    parser.add_argument("--out", type=Path, default=Path("/tmp/pagedserve-priority"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = checkpoint(args.out / f"model-{args.shape}", args.shape)
    name = model_dir.name
    urgent = ("--request-rate", str(args.rate))
    compute = f"--read-ahead {args.read_ahead}"
    with pagedserve_up(str(model_dir), args.out / "redis", compute_args=compute) as url:
        warm_up(url, name, model_dir, args.out / "warm", ignore_eos=True)
        alone = bench(
            url, name, model_dir, args.urgent, args.out / "alone.json", True, 5, workload=urgent
        )
        results: dict[str, Any] = {}

        def low() -> None:
            flags = ("--priority", str(args.low))
            path = args.out / "low.json"
            results["low"] = bench(
                url, name, model_dir, args.requests, path, True, 6, workload=flags
            )

        sender = threading.Thread(target=low)
        sender.start()
        time.sleep(args.after)
        path = args.out / "urgent.json"
        results["urgent"] = bench(url, name, model_dir, args.urgent, path, True, 5, workload=urgent)
        sender.join()
    print("| run | completed | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms |")
    print("|---|---|---|---|---|---|")
    print(row("priority 0, alone", alone))
    print(row("priority 0, under overload", results["urgent"]))
    print(row(f"priority {args.low}, the overload", results["low"]))
    ratio = results["urgent"]["ttft_ms"]["p99"] / alone["ttft_ms"]["p99"]
    print(f"priority-0 TTFT p99 under overload: {ratio:.2f}x alone (goal: at most 2x)")


if __name__ == "__main__":
    main()
