"""RPC round trip of the per-step kvstore call: a decode step of 256 requests.

Starts a real daemon (`pagedserve kvstore`, ipc://), registers a worker, admits 256 requests
(512-token prompts), then times `Step` calls that append one token to each of the 256 (every
16th step gives each request a new block): a columnar `TokenBatch`, or with --items one
`AppendItem` per request; and, for the transport floor, `Ping`.

    python bench/rpc.py [--requests 256] [--steps 1000] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore import protocol as p  # noqa: E402
from kvstore.client import KVClient  # noqa: E402
from pagedserve.procs import spawn_kvstore  # noqa: E402


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--client-spin-us", type=float, default=0.0)
    parser.add_argument("--busy-poll", action="store_true", help="the daemon's --busy-poll")
    parser.add_argument("--items", action="store_true", help="one AppendItem per request")
    args = parser.parse_args()
    endpoint = f"ipc:///tmp/pagedserve-bench-{uuid.uuid4().hex[:8]}.sock"
    tokens = args.requests * (args.prompt + args.steps + args.warmup + 16)
    kv_gib = max(0.05, tokens / 16 * 8192 * 1.2 / (1 << 30))  # tiny model: 8 KiB blocks
    flags = [
        "--device",
        args.device,
        "--kv-memory",
        f"{kv_gib:.3f}GiB",
        "--swap-memory",
        "0",
        "--log-level",
        "WARNING",
    ]
    daemon = spawn_kvstore(endpoint, [*flags, "--busy-poll"] if args.busy_poll else flags)
    try:
        client = KVClient(endpoint, spin_s=args.client_spin_us * 1e-6)
        client.call(p.Register("bench", [(16, 0.001)], args.device, os.getpid()))
        ids = [f"req-{i}" for i in range(args.requests)]
        admits = [
            p.AdmitItem(r, [i * 100_000 + t for t in range(args.prompt)]) for i, r in enumerate(ids)
        ]
        client.call(p.Step("bench", admits=admits))
        lengths = {r: args.prompt for r in ids}
        step_s: list[float] = []
        for step in range(args.warmup + args.steps):
            if args.items:
                step_body = p.Step(
                    "bench", appends=[p.AppendItem(r, [step], lengths[r]) for r in ids]
                )
            else:
                batch = p.TokenBatch(ids, [step] * len(ids), [lengths[r] for r in ids])
                step_body = p.Step("bench", tokens=batch)
            start = time.perf_counter()
            reply = client.call(step_body)
            elapsed = time.perf_counter() - start
            assert isinstance(reply, p.StepReply) and not reply.errors, reply
            for r in ids:
                lengths[r] += 1
            if step >= args.warmup:
                step_s.append(elapsed)
        ping_s = []
        for _ in range(args.steps):
            start = time.perf_counter()
            client.call(p.Ping())
            ping_s.append(time.perf_counter() - start)
        step_p50, step_p99 = percentiles(step_s)
        ping_p50, ping_p99 = percentiles(ping_s)
        print(
            f"# {time.strftime('%Y-%m-%d')} {platform.node()} {platform.machine()}, "
            f"{os.cpu_count()} cores, python {platform.python_version()}"
        )
        print(f"# {' '.join(sys.argv)}")
        print("| call | p50 µs | p99 µs |")
        print("|---|---|---|")
        daemon_mode = "busy-poll" if args.busy_poll else "poll"
        mode = f"client spin {args.client_spin_us:.0f} µs, daemon {daemon_mode}"
        shape = f"{args.requests} AppendItems" if args.items else f"TokenBatch of {args.requests}"
        call = f"Step, {shape}, 1 token each ({mode})"
        print(f"| {call} | {step_p50 * 1e6:.0f} | {step_p99 * 1e6:.0f} |")
        print(f"| Ping ({mode}) | {ping_p50 * 1e6:.0f} | {ping_p99 * 1e6:.0f} |")
        client.close()
    finally:
        daemon.send_signal(2)
        daemon.wait(15)


if __name__ == "__main__":
    main()
