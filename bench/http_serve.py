"""Serving over HTTP, the way users meet it: the same `pagedserve bench` client drives
`pagedserve up` and `transformers serve --continuous-batching` (and, for the ratio, the engine
alone: `bench/serve.py --mode ours`), one after the other on one GPU.

The model is a random-weight checkpoint of the shape asked for (``--shape 1b``: Llama-3.2-1B,
``8b``: Llama-3.1-8B), bf16, saved with a word-level tokenizer of its whole vocabulary (token
``i`` is the word ``w{i}``), so prompts of exact token lengths travel as text and every generated
token streams as text. Both servers get the same requests (seeded): chat completions, prompts
64-1024 tokens, ``max_tokens`` 32-512, greedy. pagedserve is sent ``ignore_eos``;
``transformers serve`` refuses it, so its outputs may stop early at the model's EOS: throughput
counts the tokens actually generated. Each server first gets 32 untimed warm-up requests.
Beside each timed run ``nvidia-smi`` samples the SM clock and power (``bench/gpu_monitor.py``):
an 8B run holds the H200 at its power limit, at a lower clock, which a figure should say.

    python bench/http_serve.py --shape 1b --requests 128 [--out DIR] [--skip-transformers]
        [--transformers-python PY] [--transformers-args=FLAGS] [--skip-pagedserve]
        [--skip-engine] [--gateways 1,4] [--max-num-seqs 256]
        [--max-num-batched-tokens 8192] [--prefill-interval 1]

At 1000 requests ``transformers serve``'s default cache runs the H200 out of memory (no request
completes); a cache of a fixed size serves them:
``--transformers-args='--cb-num-blocks 4096 --cb-max-batch-tokens 2048'`` (BENCHMARKS.md).

``transformers serve`` needs the packages of ``transformers[serving]``; on a host without a
package index, ``bench/transformers_serving.sh`` downloads their wheels here and installs them
there in a venv over the host's packages, and prints the ``--transformers-python`` to pass.
    python bench/http_serve.py --shape 1b --requests 128 --guided-fractions 0,0.5

With ``--guided-fractions``, pagedserve alone serves the same seeded requests once per fraction,
that share of them asking for JSON of a random JSON Schema (``response_format``), on a checkpoint
whose byte-level tokenizer can spell JSON (the word-level one cannot).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_monitor import GpuMonitor  # noqa: E402
from bench.shapes import checkpoint  # noqa: E402
from compute.batch.scheduler import SchedulerConfig  # noqa: E402
from gateway.config import ADMIN_TOKEN_ENV  # noqa: E402
from pagedserve.config import add_arguments, from_namespace, to_flags  # noqa: E402
from pagedserve.procs import interrupt  # noqa: E402
from pagedserve.redis_server import free_port  # noqa: E402

# The engines send their step totals about once a second: after a run, wait for the next ones.
TIMELINE_WAIT_S = 1.5
WORKER_DEFAULTS = SchedulerConfig()  # frozen


def wait_http(url: str, process: subprocess.Popen[bytes], timeout_s: float, ok: bool) -> None:
    """Until ``url`` answers 200 (``ok``), or answers at all."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            if not ok:
                return
            time.sleep(1)
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{url} did not answer in {timeout_s} s")


def bench(
    url: str,
    model: str,
    model_dir: Path,
    requests: int,
    out: Path,
    ignore_eos: bool,
    seed: int = 0,
    guided: float | None = None,
    processes: int = 1,
    workload: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One run of the client, with the GPU's clock and power sampled beside it (``gpu``).
    ``workload``: more flags of ``pagedserve bench`` (another workload), which win over these.
    ``guided``: that fraction of the requests asks for JSON of a random schema; prompts are
    16-256 words then (about 100-1500 tokens of the byte-level tokenizer, whose text would not
    re-encode to the drawn token ids)."""
    flags = ["--model", model, "--endpoint", "chat", "--seed", str(seed)]
    flags += ["--num-requests", str(requests)]
    if guided is None:
        flags += ["--tokenizer", str(model_dir), "--input-len", "64:1024"]
    else:
        flags += ["--guided-fraction", str(guided), "--input-len", "16:256"]
    flags += ["--output-len", "32:512", "--ignore-eos" if ignore_eos else "--no-ignore-eos"]
    flags += ["--processes", str(processes)]  # client processes (``pagedserve bench``)
    flags += workload  # argparse: the last of a repeated flag wins
    with GpuMonitor() as gpu:
        result = client(url, flags, out)
    result["gpu"] = gpu.summary()
    return result


def client(url: str, flags: list[str], out: Path) -> dict[str, Any]:
    """`pagedserve bench --base-url url *flags` to its end (its report on stdout): its result."""
    command = [sys.executable, "-m", "pagedserve.cli", "bench", "--base-url", url, *flags]
    command += ["--result-json", str(out), "--no-progress"]
    subprocess.run(command, cwd=ROOT, check=True, timeout=3600)
    return dict(json.loads(out.read_text()))


def warm_up(
    url: str, model: str, model_dir: Path, out: Path, ignore_eos: bool, guided: float | None = None
) -> None:
    """32 requests of the same shape (another seed: no prompt of the timed run is cached), not
    timed: kernels compile on first use (Triton specializes on shapes), and a fresh machine's
    first requests would otherwise pay for it (seen: TTFT p50 1.6 s instead of 0.6 s)."""
    warmup = out.with_suffix(".warmup.json")
    bench(url, model, model_dir, 32, warmup, ignore_eos, seed=1, guided=guided)


def run_pagedserve(
    model_dir: Path,
    requests: int,
    out: Path,
    guided: list[float] | None = None,
    gateways: int = 1,
    kvstore_args: str = "",
    scheduling: SchedulerConfig = WORKER_DEFAULTS,
) -> list[dict[str, Any]]:
    """The client's runs against one ``pagedserve up`` (``gateways`` gateway processes, extra
    ``kvstore_args``, a worker scheduling as ``scheduling`` says): the standard workload, or one
    run per fraction of ``guided`` (same seed: the same prompts, a growing share of them
    guided)."""
    redis_dir = out.parent / "redis"
    up = pagedserve_up(str(model_dir), redis_dir, "cuda", kvstore_args, gateways, scheduling)
    with up as url:
        if guided is None:
            warm_up(url, model_dir.name, model_dir, out, ignore_eos=True)
            before = timelines(url)
            result = bench(url, model_dir.name, model_dir, requests, out, ignore_eos=True)
            time.sleep(TIMELINE_WAIT_S)
            result["worker_timeline"] = timeline_delta(before, timelines(url))
            print(f"worker step timeline over the run ({gateways} gateways): "
                  f"{result['worker_timeline']}")  # fmt: skip
            print(f"GPU during the run: {result['gpu']}")
            return [result]
        warm_up(url, model_dir.name, model_dir, out, True, guided=max(guided))
        runs = []
        for fraction in guided:  # the same prompts each time: none finds the last run's cached
            reset_prefix_cache(url)
            path = out.with_suffix(f".{fraction}.json")
            runs.append(bench(url, model_dir.name, model_dir, requests, path, True, 0, fraction))
        return runs


@contextlib.contextmanager
def pagedserve_up(
    model: str,
    redis_dir: Path,
    device: str = "cuda",
    kvstore_args: str = "",
    gateways: int = 1,
    scheduling: SchedulerConfig = WORKER_DEFAULTS,
    up_args: tuple[str, ...] = (),
    env_extra: dict[str, str] | None = None,
    compute_args: str = "",
) -> Iterator[str]:
    """``pagedserve up`` of ``model`` on ``device`` (``kvstore_args``: extra kvstore flags;
    ``gateways``: gateway processes; ``scheduling``: the worker's; ``up_args``: more flags of
    ``up``; ``env_extra``: its environment's additions, e.g. ``CUDA_VISIBLE_DEVICES``;
    ``compute_args``: the worker's flags besides ``scheduling``), with an
    admin token (``$PAGEDSERVE_ADMIN_TOKEN``, set if unset); its URL once healthy; stopped
    (SIGINT) on leaving."""
    port = free_port()
    os.environ.setdefault(ADMIN_TOKEN_ENV, secrets.token_urlsafe(16))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **(env_extra or {}),
    }
    command = [sys.executable, "-m", "pagedserve.cli", "up", "--device", device, "--port"]
    command += [str(port), "--model", model, "--redis-dir", str(redis_dir)]
    if kvstore_args:
        command += [f"--kvstore-args={kvstore_args}"]
    worker = " ".join([*to_flags(scheduling), compute_args])
    command += ["--gateways", str(gateways), f"--compute-args={worker}"]
    command += list(up_args)
    process = subprocess.Popen(command, cwd=ROOT, env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", process, 900, ok=True)
        yield f"http://127.0.0.1:{port}"
    finally:
        interrupt(process)


def admin(url: str, path: str, method: str = "GET") -> Any:
    """The admin API's JSON answer, with the admin token this script gave ``pagedserve up``."""
    headers = {"Authorization": f"Bearer {os.environ[ADMIN_TOKEN_ENV]}"}
    request = urllib.request.Request(f"{url}{path}", method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def timelines(url: str) -> dict[str, Any]:
    """The workers' running step totals (``/admin/requests``), by worker id."""
    return {w["worker_id"]: w["timeline"] for w in admin(url, "/admin/requests")["workers"]}


def timeline_delta(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Steps, tokens, device and host ms per phase between two ``timelines`` (the engines
    send their totals about once a second: the last second of the run may be missing; an idle
    engine's waits for requests are neither steps nor in a phase; a worker restarted between
    them counts from its restart)."""
    parts = []
    for worker, end in after.items():
        zero: dict[str, Any] = {"steps": 0, "tokens": 0, "device_s": 0.0, "phase_s": {}}
        start = before.get(worker) or zero
        if not end:
            continue
        if end["steps"] < start["steps"]:  # restarted meanwhile: its totals began again
            start = zero
        steps = end["steps"] - start["steps"]
        phases = {
            k: round((v - start["phase_s"].get(k, 0.0)) * 1e3) for k, v in end["phase_s"].items()
        }
        device_ms = round((end["device_s"] - start["device_s"]) * 1e3)
        tokens = end["tokens"] - start["tokens"]
        parts.append(
            f"{worker}: {steps} steps, {tokens} tokens, device {device_ms} ms, host ms {phases}"
        )
    return "; ".join(parts)


def kvstore_busy(url: str) -> dict[str, float]:
    """The kvstore daemon's busy seconds so far, by activity (``/admin/cache``)."""
    busy: dict[str, float] = admin(url, "/admin/cache?top=0")["kvstore_busy_s"]
    return busy


def busy_delta(before: dict[str, float], after: dict[str, float], wall_s: float) -> str:
    """The daemon's busy seconds between two ``kvstore_busy`` per second of ``wall_s``, by
    activity, largest first: a share near 1 is a daemon the workers wait for."""
    shares = {k: (v - before.get(k, 0.0)) / wall_s for k, v in after.items()}
    return ", ".join(f"{k} {v:.3f}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))


def reset_prefix_cache(url: str) -> None:
    """``POST /admin/cache/reset``."""
    print(f"prefix cache reset: {json.dumps(admin(url, '/admin/cache/reset', 'POST'))}")


def run_transformers(
    model_dir: Path, requests: int, out: Path, python: str, extra: str = ""
) -> dict[str, Any]:
    """``transformers serve --continuous-batching --cb-use-cuda-graph`` run by ``python`` (an
    interpreter that has ``transformers[serving]``'s packages: ``bench/transformers_serving.sh``)
    with the client's warm-up and run against it; ``extra``: more of its flags (split on
    spaces)."""
    port = free_port()
    cli = "from transformers.cli.transformers import main; main()"
    command = [python, "-c", cli, "serve", str(model_dir), "--port", str(port)]
    command += ["--device", "cuda"]
    command += ["--dtype", "bfloat16", "--continuous-batching", "--cb-use-cuda-graph"]
    command += extra.split()
    (Path.home() / ".cache" / "huggingface" / "hub").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
    process = subprocess.Popen(command, cwd=ROOT, env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", process, 900, ok=False)
        url = f"http://127.0.0.1:{port}"
        warm_up(url, str(model_dir), model_dir, out, ignore_eos=False)
        result = bench(url, str(model_dir), model_dir, requests, out, ignore_eos=False)
        print(f"GPU during transformers serve's run: {result['gpu']}")
        return result
    finally:
        interrupt(process, grace_s=15)  # seen: transformers 5.17 never exiting on SIGINT


def by_class(result: dict[str, Any]) -> str:
    """Output tokens and TPOT p50 of the guided and the other requests of one run."""
    parts = []
    for name, guided in (("guided", True), ("unguided", False)):
        rows = [r for r in result["requests"] if r["guided"] == guided and not r["error"]]
        tpots = sorted(r["tpot_ms"] for r in rows if r["tpot_ms"] is not None)
        tpot = f"{tpots[len(tpots) // 2]:.1f}" if tpots else "-"
        tokens = sum(r["output_tokens"] for r in rows)
        parts.append(f"{name}: {len(rows)} requests, {tokens} tokens, TPOT p50 {tpot} ms")
    return "; ".join(parts)


def row(name: str, result: dict[str, Any]) -> str:
    return (
        f"| {name} | {result['completed']}/{result['completed'] + result['failed']} | "
        f"{result['output_tok_s']:.0f} | {result['ttft_ms']['p50']:.0f} / "
        f"{result['ttft_ms']['p99']:.0f} | {result['itl_ms']['p50']:.1f} / "
        f"{result['itl_ms']['p99']:.1f} | {result['tpot_ms']['p50']:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["1b", "8b"], default="1b")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("/tmp/pagedserve-http-bench"))
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-pagedserve", action="store_true", help="its HTTP runs")
    parser.add_argument(
        "--transformers-python",
        default=sys.executable,
        help="the interpreter that runs transformers serve: one with the packages of "
        "transformers[serving] (bench/transformers_serving.sh install prints it)",
    )
    parser.add_argument(
        "--transformers-args",
        default="",
        help="extra flags of transformers serve (quoted; e.g. --cb-max-memory-percent 0.5: at "
        "1000 requests its default KV cache left no room for the forward on the H200)",
    )
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument(
        "--gateways", default="1", help="comma-separated gateway process counts: a run each"
    )
    parser.add_argument(
        "--kvstore-args", default="", help="extra kvstore flags of pagedserve's runs (quoted)"
    )
    add_arguments(parser, SchedulerConfig)  # pagedserve's worker's and the engine alone's
    parser.add_argument(
        "--guided-fractions",
        default="",
        help="comma-separated fractions of requests asking for JSON of a random schema (e.g. "
        "0,0.5): pagedserve alone, one run each, on a byte-level tokenizer's checkpoint",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    scheduling = from_namespace(SchedulerConfig, args)
    rows = ["| server | completed | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
            "TPOT p50 ms |", "|---|---|---|---|---|---|"]  # fmt: skip
    if args.guided_fractions:
        fractions = [float(f) for f in args.guided_fractions.split(",")]
        model_dir = checkpoint(args.out / f"model-{args.shape}-bytes", args.shape, True)
        runs = run_pagedserve(model_dir, args.requests, args.out / "guided.json", fractions)
        for fraction, result in zip(fractions, runs, strict=True):
            rows.append(row(f"pagedserve (HTTP), {fraction:.0%} guided", result))
            print(f"{fraction:.0%} guided: {result['guided_parsed']} of {result['guided']} parse, "
                  f"{result['guided_cut']} cut by max_tokens; {by_class(result)}")  # fmt: skip
        print("\n".join(rows))
        return
    model_dir = checkpoint(args.out / f"model-{args.shape}", args.shape)
    http: dict[int, dict[str, Any]] = {}
    counts = [] if args.skip_pagedserve else [int(n) for n in args.gateways.split(",")]
    for count in counts:
        out = args.out / f"pagedserve-{count}gw.json"
        [http[count]] = run_pagedserve(
            model_dir,
            args.requests,
            out,
            gateways=count,
            kvstore_args=args.kvstore_args,
            scheduling=scheduling,
        )
        label = "" if count == 1 else f", {count} gateway processes"
        rows.append(row(f"pagedserve (HTTP{label})", http[count]))
    if not args.skip_transformers:
        try:
            theirs = run_transformers(
                model_dir,
                args.requests,
                args.out / "transformers.json",
                args.transformers_python,
                args.transformers_args,
            )
        except RuntimeError as err:  # e.g. an image without transformers[serving]'s packages
            print(f"transformers serve did not run ({err}; its output is above): skipped")
        else:
            rows.append(row("transformers serve --continuous-batching (HTTP)", theirs))
            for count, ours in http.items():
                ratio = ours["output_tok_s"] / theirs["output_tok_s"]
                print(f"pagedserve ({count} gateways) / transformers: {ratio:.2f}x")
    if not args.skip_engine:
        command = [sys.executable, "bench/serve.py", "--mode", "ours", "--shape", args.shape]
        command += ["--requests", str(args.requests), *to_flags(scheduling)]
        command += ["--tokenizer", str(model_dir)]  # the very requests of the HTTP runs
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
        engine = json.loads(done.stdout.strip().splitlines()[-1])
        tok_s = engine["tokens"] / engine["seconds"]
        print(f"engine alone: {engine['steps']} steps, host seconds per phase {engine['phases']}, "
              f"device seconds {engine['device_s']}; per forward path (steps, device seconds, "
              f"tokens) {engine['device_by_path']}; "
              f"{engine['preemptions']} preemptions")  # fmt: skip
        print(f"engine alone (bench/serve.py, the same requests as token ids): {tok_s:.0f}")
        for count, result in http.items():
            print(f"HTTP ({count} gateways) / engine alone: {result['output_tok_s'] / tok_s:.2f}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
