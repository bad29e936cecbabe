"""Start-up time: ``pagedserve up`` from launch to its first ``/health`` 200, and where it went.

    python3 bench/startup.py --model DIR|tiny|1b|8b [--device cpu|cuda] [--runs N]
        [--cache fresh|warm|off] [--source DIR] [--checkpoints DIR] [--log-dir DIR]

Each run starts ``pagedserve up`` on a free port with a kvstore endpoint and a Redis directory of
its own, waits for ``/health`` to answer 200, stops it (SIGINT) and prints the seconds from the
launch to the first 200, then the moments (seconds after the launch) at which the stack's log
showed each start-up step, and the worker's own ``start-up phases`` line where its code logs one.
``1b``/``8b``: the benchmarks' random-weight checkpoints (``bench/shapes.py``, built once under
``--checkpoints``).

``--cache``: where the worker keeps its cost-model profile (``$PAGEDSERVE_PROFILE_CACHE``):
``fresh`` (default) a new empty directory per run: the worker measures; ``warm`` one directory
for every run, filled by a first, untimed start (the same key: a restart of the same worker);
``off`` no cache (the worker measures). Code older than the cache ignores the variable.
``--source DIR``: run the code of another checkout (e.g. ``git archive OLD | tar -x -C DIR``),
this script unchanged: the "before" of a change.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pagedserve.procs import interrupt  # noqa: E402
from pagedserve.redis_server import free_port  # noqa: E402

# (what, a regular expression over the stack's log lines): the first line matching each is shown
STEPS = (
    ("kvstore serving", r"kvstore serving on"),
    ("worker: loading the model", r"pagedserve.compute: (loading|building tiny)"),
    ("worker: model ready", r"model ready:"),
    ("worker: profiling starts", r"measuring prefill times|cost-model profile"),
    ("worker: registered", r"worker \S+ registered:"),
    ("worker: serving", r"worker \S+ serving"),
)
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def wait_health(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> float:
    """Seconds (monotonic clock) at which ``url`` first answered 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pagedserve up exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return time.monotonic()
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not answer 200 in {timeout_s} s")


def start_once(args: argparse.Namespace, model: str, cache: str, log: Path) -> float:
    """One ``pagedserve up`` to its first healthy answer, stopped; the seconds it took. Its
    output goes to ``log``; step moments are read from it afterwards."""
    port = free_port()
    source = Path(args.source).resolve()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")]),
    }
    env["PAGEDSERVE_PROFILE_CACHE"] = cache
    redis_dir = tempfile.mkdtemp(prefix="pagedserve-startup-redis-")
    command = [sys.executable, "-m", "pagedserve.cli", "up", "--model", model]
    command += ["--device", args.device, "--port", str(port), "--redis-dir", redis_dir]
    command += ["--endpoint", f"ipc:///tmp/pagedserve-startup-{port}.sock"]
    command += ["--startup-timeout-s", str(args.timeout_s)]
    if args.compute_args:
        command += [f"--compute-args={args.compute_args}"]
    with log.open("wb") as out:
        launched_wall, launched = time.time(), time.monotonic()
        process = subprocess.Popen(
            command, cwd=source, env=env, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            healthy = wait_health(f"http://127.0.0.1:{port}/health", process, args.timeout_s)
        finally:
            interrupt(process)
    seconds = healthy - launched
    print(f"  launch -> /health 200: {seconds:.1f} s   (log: {log})")
    for line in steps(log, launched_wall):
        print(f"    {line}")
    return seconds


def steps(log: Path, launched_wall: float) -> list[str]:
    """The moments of ``STEPS`` in the log, and the worker's phase lines, verbatim."""
    lines = log.read_text(errors="replace").splitlines()
    found = []
    for what, pattern in STEPS:
        for line in lines:
            stamp = STAMP.match(line)
            if stamp and re.search(pattern, line):
                at = datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found.append(f"{at - launched_wall:7.1f} s  {what}")
                break
    found += [line.split(": ", 1)[-1] for line in lines if "start-up phases" in line]
    found += [line.split(": ", 1)[-1] for line in lines if "cost-model profile" in line]
    return found


def model_path(args: argparse.Namespace) -> str:
    if args.model not in ("1b", "8b"):
        return args.model
    from bench.shapes import checkpoint

    return str(checkpoint(Path(args.checkpoints) / args.model, args.model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="checkpoint dir, 'tiny', '1b' or '8b'")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--cache", choices=["fresh", "warm", "off"], default="fresh")
    parser.add_argument("--source", default=str(ROOT), help="the checkout whose code runs")
    parser.add_argument("--checkpoints", default="/tmp/pagedserve-shapes", help="for 1b/8b")
    parser.add_argument("--compute-args", default="", help="extra `pagedserve compute` flags")
    parser.add_argument("--log-dir", default="", help="keep the stack's logs here")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    args = parser.parse_args()
    model = model_path(args)
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="pagedserve-startup-"))
    logs.mkdir(parents=True, exist_ok=True)
    warm = tempfile.mkdtemp(prefix="pagedserve-profiles-")
    print(f"pagedserve up --model {model} --device {args.device} (code: {args.source})")
    if args.cache == "warm":
        print("  (untimed first start: fills the profile cache)")
        start_once(args, model, warm, logs / "fill.log")
    times = []
    for run in range(args.runs):
        cache = {"fresh": tempfile.mkdtemp(prefix="pagedserve-profiles-"), "warm": warm}
        times.append(start_once(args, model, cache.get(args.cache, "off"), logs / f"run{run}.log"))
    print(
        f"launch -> /health 200, {args.cache} cache: " + ", ".join(f"{t:.1f}" for t in times) + " s"
    )


if __name__ == "__main__":
    main()
