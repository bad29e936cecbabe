"""Ceilings held for many seconds, as a serving run holds them: bf16 matmul TFLOP/s and device
copy TB/s second by second, with the SM clock and power draw (``nvidia-smi``) beside them.

A burst of kernels (``bench/kernels.py``, ``bench/decode_step.py``) runs at the top boost clock.
A run of tens of seconds that keeps the tensor cores busy can reach the board's power limit, and
the GPU then lowers its SM clock (``clocks_event_reasons`` "SW power cap"), so compute-bound work
slows. This measures how much, for the bound of ``bench/schedule_bound.py``.

    python bench/sustained.py [--seconds 20] [--m 4096 --k 4096 --n 14336] [--copy-mib 1024]
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_monitor import QUERY


def gpu_state() -> str:
    """The SM clock, power draw and active clock-event reasons, or why they are unknown."""
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"nvidia-smi: {err}"
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else done.stderr.strip()


def hold(
    name: str, work: Callable[[], object], unit_per_call: float, unit: str, seconds: float
) -> None:
    """Runs ``work()`` back to back for ``seconds``, printing its rate each second."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    second = 0
    while time.perf_counter() - start < seconds:
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            for _ in range(10):
                work()
            calls += 10
            torch.cuda.synchronize()
        rate = calls * unit_per_call / (time.perf_counter() - t0)
        second += 1
        print(f"{name} second {second}: {rate:.3g} {unit}; {gpu_state()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each is held")
    parser.add_argument("--m", type=int, default=4096, help="matmul rows (tokens)")
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=14336)
    parser.add_argument("--copy-mib", type=int, default=1024, help="device copy buffer size")
    args = parser.parse_args()
    print(f"idle: {gpu_state()}")
    hold_matmul(args.m, args.k, args.n, args.seconds)
    time.sleep(5)  # let the clock recover before the copy
    hold_copy(args.copy_mib, args.seconds)


def hold_matmul(m: int, k: int, n: int, seconds: float) -> None:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    work = functools.partial(torch.matmul, a, b.t(), out=out)
    hold(f"matmul {m}x{k}x{n}", work, 2.0 * m * k * n / 1e12, "TFLOP/s", seconds)


def hold_copy(mib: int, seconds: float) -> None:
    src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    work = functools.partial(dst.copy_, src)
    hold(f"copy {mib} MiB", work, 2.0 * src.numel() / 1e12, "TB/s (read + write)", seconds)


if __name__ == "__main__":
    main()
