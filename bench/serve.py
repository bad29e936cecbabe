"""End-to-end serving throughput on a GPU: kvstore (CUDA IPC pool) + engine + Redis, no HTTP.

A Llama-3.2-1B-shaped random-weight bf16 model serves 128 requests (prompts uniform 64-1024
tokens, outputs uniform 32-512, ignore_eos, seed 0): all submitted at once to Redis, served by
the engine until every output stream is final (the models and workload: ``bench/shapes.py``).
Baselines in the same run (``bench/hf_baselines.py``), each in its own process (nothing of ours
imported, all GPU memory back between runs):

- transformers' continuous batching (``init_continuous_batching``, the manager behind
  ``generate_batch``, with ``attn_implementation="paged|sdpa"``), each request with its own
  ``max_new_tokens``;
- transformers ``generate`` with static batches of 32 (left padding, each batch runs to its
  longest output; only the requested tokens count).

    python bench/serve.py [--requests 128] [--max-num-seqs 256] [--prefill-interval 1]
        [--skip-baselines]
    python bench/serve.py --mode ours|hf-cb|hf-static [--cuda-graphs N]   (one run, JSON out)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import pstats
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.device_window import DeviceWindow  # noqa: E402
from bench.shapes import SHAPES, Jobs, build_model, workload  # noqa: E402
from compute.batch.scheduler import SchedulerConfig  # noqa: E402  (pure Python, as is the next)
from pagedserve.config import add_arguments, from_namespace, to_flags  # noqa: E402

if TYPE_CHECKING:  # the baselines' processes import none of our GPU code
    from compute.loop.engine import Engine


# ----------------------------------------------------------------------------- ours
def stack(
    model_dir: str, kv_memory: str = "40"
) -> contextlib.AbstractContextManager[tuple[str, str]]:
    """An embedded Redis and a kvstore daemon on CUDA; yields (kvstore endpoint, Redis URL)."""
    return stack_on(
        model_dir, ["--dtype", "bfloat16", "--device", "cuda", "--kv-memory", kv_memory]
    )


@contextlib.contextmanager
def stack_on(model_dir: str, flags: list[str]) -> Iterator[tuple[str, str]]:
    """An embedded Redis and a kvstore daemon for ``model_dir`` started with ``flags``; yields
    (kvstore endpoint, Redis URL)."""
    from pagedserve.procs import spawn_kvstore
    from pagedserve.redis_server import EmbeddedRedis

    server = EmbeddedRedis.start()
    endpoint = f"ipc:///tmp/pagedserve-bench-{uuid.uuid4().hex[:8]}.sock"
    flags = ["--model", model_dir, *flags, "--log-level", "WARNING"]
    kvstore = spawn_kvstore(endpoint, flags, 300)
    try:
        yield endpoint, server.url
    finally:
        kvstore.send_signal(2)
        kvstore.wait(60)
        server.stop()


def serve_jobs(
    engine: Engine,
    url: str,
    jobs: Jobs,
    tag: str,
    window: DeviceWindow | None = None,
    trace: list[tuple[str, int, float]] | None = None,
) -> dict[str, Any]:
    """Submits ``jobs`` (prompt, max_tokens) greedy with ignore_eos and steps ``engine`` until
    every output stream is final (``window``: profiles some of its steps; ``trace``: gets
    (forward path, computed tokens, device ms) of every processed step, in order)."""
    import redis
    import redis.asyncio

    from contracts import queue_gateway, queue_keys, queue_worker
    from contracts.records import RequestRecord, SamplingParams

    records = [
        RequestRecord(
            f"{tag}-{i}",
            prompt,
            SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True),
            "bench",
        )
        for i, (prompt, m) in enumerate(jobs)
    ]

    async def submit() -> None:
        client = redis.asyncio.Redis.from_url(url)
        for record in records:
            await queue_gateway.submit(client, record)
        await client.aclose()

    r = redis.Redis.from_url(url)
    phases_then = engine.phases()
    device_s, fed = engine.model_step.device_s, engine.model_step.tokens_fed
    by_path = dict(engine.model_step.by_path.totals)
    start = time.perf_counter()
    asyncio.run(submit())
    steps = 0
    while True:
        if window is not None:
            window.before_step(steps, engine.model_step.device_s)
        before = dict(engine.model_step.by_path.totals) if trace is not None else {}
        engine.step()
        if trace is not None:
            for path, (n, seconds, computed) in engine.model_step.by_path.totals.items():
                n0, seconds0, computed0 = before.get(path, (0, 0.0, 0))
                if n > n0:  # one step processed (a step processes at most one)
                    trace.append((path, computed - computed0, (seconds - seconds0) * 1e3))
        steps += 1
        # done: every request acked (acks delete the entry) after its final record was published
        if not engine.active and r.xlen(queue_keys.REQUEST_STREAM) == 0:
            break
    seconds = time.perf_counter() - start
    if window is not None:
        window.finish(steps, engine.model_step.device_s)
    streamed = [queue_worker.read_streamed(r, rec.req_id) for rec in records]
    assert all(s.final for s in streamed), "a request was not finished"
    tokens = sum(len(s.sequences[0].token_ids) for s in streamed)
    assert tokens == sum(m for _, m in jobs), "lost tokens"
    phases = {
        k: round(v - phases_then.get(k, 0.0), 3)
        for k, v in engine.phases().items()
        if v != phases_then.get(k)  # the phases of the run
    }
    model = engine.model_step
    paths = {}  # forward path -> (steps, device seconds, tokens) of the run
    for path, (steps_now, device_now, computed) in model.by_path.totals.items():
        steps_then, device_then, computed_then = by_path.get(path, (0, 0.0, 0))
        paths[path] = (
            steps_now - steps_then,
            round(device_now - device_then, 3),
            computed - computed_then,
        )
    return {
        "seconds": seconds,
        "tokens": tokens,
        "steps": steps,
        "phases": phases,
        "device_s": round(model.device_s - device_s, 3),
        "tokens_fed": model.tokens_fed - fed,
        "device_by_path": paths,
    }


def run_ours(
    jobs: Jobs,
    scheduling: SchedulerConfig,
    cuda_graphs: int,
    cprofile: bool = False,
    fused: bool = True,
    shape: str = "1b",
    graph_tokens: int = 2048,
    tokenizer: str = "",
    window: DeviceWindow | None = None,
    trace: list[tuple[str, int, float]] | None = None,
) -> dict:
    """The engine alone; it detokenizes with ``tokenizer``'s (a checkpoint directory) as the
    worker would, else with the byte tokenizer."""
    import compute.model.attention  # noqa: F401  (registers the "paged" attention function)
    from compute.loop.engine import Engine
    from compute.model.models import byte_tokenizer, load_tokenizer
    from compute.model.profile import measure_prefill
    from contracts.heap import tune_gc_for_serving
    from kvstore import protocol as p
    from kvstore.client import KVClient

    config = SHAPES[shape]()
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)  # the kvstore reads the geometry from it
        model = build_model(config, "paged", fused)
        with stack(model_dir) as (endpoint, url), KVClient(endpoint) as kv:
            import redis

            profile = measure_prefill(model, 16, (128, 1024), repeats=2)
            started = time.perf_counter()
            engine = Engine(
                "bench",
                model,
                load_tokenizer(tokenizer) if tokenizer else byte_tokenizer(),
                kv,
                redis.Redis.from_url(url),
                scheduling,
                profile,
                cuda_graph_max_batch=cuda_graphs,
                cuda_graph_max_tokens=graph_tokens,
            )
            capture_s = time.perf_counter() - started
            serve_jobs(engine, url, jobs[:4], "warmup")  # compiles the kernels
            kv.call(p.ResetCache())  # the timed run must not hit the warm-up's prompts
            tune_gc_for_serving()  # as the worker does once it serves
            profiler = cProfile.Profile() if cprofile else None
            if profiler is not None:
                profiler.enable()
            result = serve_jobs(engine, url, jobs, "run", window, trace)
            if profiler is not None:  # the host's view of the timed run, on stderr
                profiler.disable()
                pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)
            stats = kv.call(p.GetStats(0))
    result["preemptions"] = stats.preemptions
    result["prefix_hit_tokens"] = stats.prefix_hit_tokens
    result["startup_s"] = round(capture_s, 1)
    return result


# ----------------------------------------------------------------------------- driver
def window_steps(text: str) -> tuple[int, int]:
    first, _, count = text.partition(":")
    if not (first.isdigit() and count.isdigit() and int(count) > 0):
        raise argparse.ArgumentTypeError(f"want FIRST:COUNT, two whole numbers, got {text!r}")
    return int(first), int(count)


def log_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # stdout carries the run's JSON


def one_run(args: argparse.Namespace) -> dict:
    jobs = workload(args.requests, tokenizer=args.tokenizer)
    if args.mode == "ours":
        graphs, fused = args.cuda_graphs, not args.unfused
        window = None
        if args.device_window:
            first, count = args.device_window
            window = DeviceWindow(first, count, out=log_line)
        trace: list[tuple[str, int, float]] | None = [] if args.step_trace else None
        result = run_ours(
            jobs,
            from_namespace(SchedulerConfig, args),
            graphs,
            args.profile,
            fused,
            args.shape,
            args.graph_tokens,
            args.tokenizer,
            window,
            trace,
        )
        if trace is not None:
            Path(args.step_trace).write_text("\n".join(json.dumps(step) for step in trace))
        return result
    from bench.hf_baselines import run_hf_continuous, run_hf_static

    if args.mode == "hf-cb":
        return run_hf_continuous(jobs)
    return run_hf_static(jobs)


def in_subprocess(mode: str, args: argparse.Namespace, *extra: str) -> dict | None:
    command = [sys.executable, __file__, "--mode", mode, "--requests", str(args.requests)]
    command += [*to_flags(from_namespace(SchedulerConfig, args)), *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"# {mode} {' '.join(extra)} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="ours: the model")
    parser.add_argument("--cuda-graphs", type=int, default=256, help="0: eager decode steps")
    parser.add_argument(
        "--graph-tokens",
        type=int,
        default=2048,
        help="CUDA graphs of mixed steps up to; 0: eager",
    )
    parser.add_argument("--skip-baselines", action="store_true")
    parser.add_argument(
        "--tokenizer",
        default="",
        help="a checkpoint directory: serve the chat requests `pagedserve bench` sends to it",
    )
    parser.add_argument("--mode", choices=["ours", "hf-cb", "hf-static"])
    parser.add_argument("--profile", action="store_true", help="ours: cProfile to stderr")
    parser.add_argument(
        "--unfused", action="store_true", help="ours: transformers' own layer forwards"
    )
    parser.add_argument(
        "--device-window",
        type=window_steps,
        metavar="FIRST:COUNT",
        help="ours, with --mode: profile COUNT engine steps from step FIRST (bench/device_window)",
    )
    parser.add_argument(
        "--step-trace",
        metavar="FILE",
        help="ours, with --mode: write each step's forward path, tokens and device ms (JSON lines)",
    )
    add_arguments(parser, SchedulerConfig)  # ours: the worker's scheduling flags
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(one_run(args)))
        return
    runs: list[tuple[str, dict | None]] = []
    if not args.skip_baselines:
        runs.append(("transformers continuous batching (paged|sdpa)", in_subprocess("hf-cb", args)))
        runs.append(
            ("transformers generate, static batches of 32", in_subprocess("hf-static", args))
        )
    runs.append(("pagedserve, eager decode", in_subprocess("ours", args, "--cuda-graphs", "0")))
    graphs = str(args.cuda_graphs)
    runs.append(
        ("pagedserve, CUDA-graph decode", in_subprocess("ours", args, "--cuda-graphs", graphs))
    )
    print(f"# {time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name()} torch {torch.__version__}")
    print(f"# {' '.join(sys.argv)}; {args.requests} requests")
    print("| system | seconds | output tokens | output tok/s | vs transformers CB |")
    print("|---|---|---|---|---|")
    base = runs[0][1] if not args.skip_baselines else None
    for name, res in runs:
        if res is None:
            print(f"| {name} | failed | | | |")
            continue
        tps = res["tokens"] / res["seconds"]
        ratio = f"{tps / (base['tokens'] / base['seconds']):.2f}" if base else "-"
        print(f"| {name} | {res['seconds']:.1f} | {res['tokens']} | {tps:.0f} | {ratio} |")
    for name, res in runs:
        if res and "phases" in res:
            print(f"# {name}: {res['steps']} steps, host seconds per phase {res['phases']}, "
                  f"device seconds {res['device_s']}, tokens fed from the device "
                  f"{res['tokens_fed']}, startup {res['startup_s']} s, preemptions "
                  f"{res['preemptions']}, prefix hits {res['prefix_hit_tokens']}")  # fmt: skip


if __name__ == "__main__":
    main()
