"""``kill -9`` of one GPU's worker under load: does every stream complete, and does the other
GPU serve on at its speed?

``pagedserve up --data-parallel-size 2`` (a worker per GPU, ``--gateways-per-gpu`` gateway
processes per GPU) serves the random workload of ``bench/http_serve.py`` (chat, prompts
64-1024 tokens, ``max_tokens`` 32-512, ``ignore_eos``) as Poisson arrivals at ``--rate``
requests/s, driven by ``pagedserve bench``; ``--kill-after`` seconds after the first of them runs
(the client builds its requests first) the worker of pool 1 gets SIGKILL (``pagedserve up``
restarts it under its id; its requests resume there).

Each response says which pool served it (``X-PagedServe-Pool``). The outage is read from the
data: the longest silence between two chunks of pool 1's streams. Reported: requests completed
and failed, and pool 0's inter-token latency p50/p99 before the outage, during it and after it
(the gaps between two chunks of one stream both inside the window), and the ratio asked of
issue 33: pool 0's ITL p99 during the outage over before (goal <= 1.2).

    python bench/kill_one_gpu.py --shape 1b [--rate 30] [--duration 45] [--kill-after 15]
    python bench/kill_one_gpu.py --device cpu --rate 4 --duration 30 --kill-after 10  # a smoke
        check: two /dev/shm pools and the tiny model, short prompts and answers
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.http_serve import admin, pagedserve_up  # noqa: E402
from bench.shapes import checkpoint  # noqa: E402


def worker_pid(pool: int) -> int:
    """The pid of the running compute worker of ``pool`` (its command line's ``--pool``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = [a.decode(errors="replace") for a in args]
        if "compute" in text and "--pool" in text and text[text.index("--pool") + 1] == str(pool):
            return int(entry.name)
    raise RuntimeError(f"no worker of pool {pool} is running")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def outage(rows: list[dict[str, Any]], pool: str) -> tuple[float, float]:
    """The longest silence between two consecutive chunks of ``pool``'s streams."""
    times = sorted(t for r in rows if r["server_pool"] == pool for t in r["chunks_s"])
    if len(times) < 2:
        raise RuntimeError(f"pool {pool} streamed nothing")
    gap = max(itertools.pairwise(times), key=lambda pair: pair[1] - pair[0])
    return gap


def itls(rows: list[dict[str, Any]], pool: str, lo: float, hi: float) -> list[float]:
    """``pool``'s inter-chunk gaps (ms) with both chunks in ``[lo, hi)``."""
    gaps = []
    for r in rows:
        if r["server_pool"] != pool:
            continue
        chunks = r["chunks_s"]
        gaps += [(b - a) * 1e3 for a, b in itertools.pairwise(chunks) if lo <= a and b < hi]
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["1b", "8b"], default="1b")
    parser.add_argument("--rate", type=float, default=30.0, help="requests / s (Poisson)")
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals")
    parser.add_argument("--kill-after", type=float, default=15.0)
    parser.add_argument("--routing", default="prefix")
    parser.add_argument("--gateways-per-gpu", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("/tmp/pagedserve-kill-one-gpu"))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result_path = args.out / f"{args.shape}-kill.json"
    up_args = ("--data-parallel-size", "2", f"--gateway-args=--routing {args.routing}")
    if args.device == "cpu":
        model, tokenizer, lengths = "tiny", "tiny", ("16:64", "8:32")
    else:
        model = tokenizer = str(checkpoint(args.out / f"model-{args.shape}", args.shape))
        lengths = ("64:1024", "32:512")
    with pagedserve_up(
        model, args.out / "redis", args.device, "", 2 * args.gateways_per_gpu, up_args=up_args
    ) as url:
        requests = int(args.rate * args.duration)
        command = [sys.executable, "-m", "pagedserve.cli", "bench", "--base-url", url]
        command += ["--endpoint", "chat", "--tokenizer", tokenizer, "--ignore-eos"]
        command += ["--input-len", lengths[0], "--output-len", lengths[1], "--no-progress"]
        warm = [*command, "--num-requests", "32", "--seed", "1"]  # compiles the kernels
        subprocess.run([*warm, "--result-json", str(result_path)], cwd=ROOT, check=True)
        command += ["--num-requests", str(requests), "--request-rate", str(args.rate)]
        command += ["--result-json", str(result_path)]
        client = subprocess.Popen(command, cwd=ROOT)
        wait_for_load(url)  # the client builds its requests first (seconds, with a tokenizer)
        time.sleep(args.kill_after)
        victim = worker_pid(1)
        os.kill(victim, signal.SIGKILL)
        print(
            f"SIGKILL to pool 1's worker (pid {victim}) {args.kill_after:.0f} s after the "
            "first requests ran",
            flush=True,
        )
        client.wait(timeout=3600)
        report(result_path, requests)  # before the stack stops: that may take a while


def wait_for_load(url: str, timeout_s: float = 300.0) -> None:
    """Returns once the kvstore runs a request (the timed run's first: the warm-up ended)."""
    deadline = time.monotonic() + timeout_s
    while sum(pool["running"] for pool in admin(url, "/admin/cache")["pools"]) == 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no request ran within {timeout_s:.0f} s")
        time.sleep(0.05)


def report(result_path: Path, requests: int) -> None:
    result = json.loads(result_path.read_text())
    rows = result["requests"]
    start, end = outage(rows, "1")
    last = max(r["end_s"] for r in rows)
    windows = {"before": (2.0, start), "outage": (start, end), "after": (end, last)}
    print(
        f"completed {result['completed']}, failed {result['failed']} of {requests}; "
        f"errors {result['errors']}; pool 1 silent from {start:.2f} s to {end:.2f} s "
        f"({end - start:.1f} s); requests by pool: "
        + ", ".join(
            f"{pool}: {sum(r['server_pool'] == pool for r in rows)}"
            for pool in sorted({r["server_pool"] for r in rows})
        )
    )
    p99: dict[str, float] = {}
    print("| pool 0, window | seconds | ITL samples | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|")
    for name, (lo, hi) in windows.items():
        gaps = itls(rows, "0", lo, hi)
        p99[name] = percentile(gaps, 0.99)
        print(
            f"| {name} | {lo:.1f}-{hi:.1f} | {len(gaps)} | {percentile(gaps, 0.5):.1f} | "
            f"{p99[name]:.1f} |"
        )
    print(f"pool 0's ITL p99 during the outage / before: {p99['outage'] / p99['before']:.2f}")


if __name__ == "__main__":
    main()
