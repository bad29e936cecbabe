"""Tensor parallelism over HTTP with `pagedserve bench`: one GPU (``tp1``: ``pagedserve up`` on GPU
0) against a worker group of two ranks on two GPUs (``tp2``: ``up --tensor-parallel-size 2``, one
kvstore splitting each pool's KV heads over both GPUs; ``tp2-nccl``: the same with every
all-reduce by NCCL; ``tp4``: four ranks; ``dp2xtp2``: two groups of two on four GPUs, one pool
each, routed by the gateway), the same checkpoint and client, in one lease. Per server:

- start-up: from ``pagedserve up`` to the gateway's first healthy answer;
- 32 untimed warm-up requests;
- a greedy drift sample: ``--drift-requests`` random prompts of 256 words, 128 tokens each, with
  their logprobs (bf16 output of TP=2 set against TP=1's once both ran);
then the ``--runs``:

- ``cN``: the random mix (prompts 64-1024 tokens, ``max_tokens`` 32-512, ``ignore_eos``), 4N
  requests, the client holding N in flight (ITL at N concurrent requests);
- ``burst``: ``--requests`` of the random mix (all sent at once; the worker runs 256 at a time, its
  ``--max-num-seqs``, so its ITL is that of 256 concurrent requests);
- ``sharegpt``: ``--requests`` of the ShareGPT-like length mix (``pagedserve bench --input-len``
  / ``--output-len`` lognormal, as ``pagedserve/bench_workloads.py`` draws them);
- ``kill`` (TP > 1, ``--kill-rank-after S``): half the burst again, rank 1's process (of every
  group) killed (SIGKILL) S seconds in; every stream must complete (the group restarts, the
  requests resume).

    python bench/tensor_parallel.py --shape 8b [--only tp1,tp2] [--runs c32,burst,kill]
    python bench/tensor_parallel.py --shape 70b --only tp2 --runs burst,sharegpt \\
        --checkpoint-dirs /dev/shm/ck70      (written tensor by tensor: bench/big_checkpoint.py)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.http_serve import (  # noqa: E402
    TIMELINE_WAIT_S,
    bench,
    busy_delta,
    kvstore_busy,
    pagedserve_up,
    row,
    timeline_delta,
    timelines,
    warm_up,
)
from bench.shapes import checkpoint  # noqa: E402

# ShareGPT's means (prompts ~220 tokens, answers ~190), long tails: ``bench_workloads.Lengths``
SHAREGPT = ("--input-len", "lognormal:4.9:1.0:4:4096", "--output-len", "lognormal:4.85:0.9:4:2048")
Sample = list[tuple[str, float]]  # a greedy completion: (token, logprob) each


def greedy_sample(url: str, model: str, n: int, vocab: int, threads: int = 32) -> list[Sample]:
    """``n`` greedy completions of 128 tokens (seeded random prompts of 256 words of the
    word-level tokenizer), with each token's logprob; ``threads`` requests at a time."""
    rng = random.Random(7)
    prompts = [" ".join(f"w{rng.randrange(vocab - 1000)}" for _ in range(256)) for _ in range(n)]

    def one(prompt: str) -> Sample:
        body = {"model": model, "prompt": prompt, "max_tokens": 128, "temperature": 0.0,
                "logprobs": 1, "ignore_eos": True}  # fmt: skip
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            logprobs = json.loads(response.read())["choices"][0]["logprobs"]
        return list(zip(logprobs["tokens"], logprobs["token_logprobs"], strict=True))

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, prompts))


def drift(base: list[Sample], other: list[Sample]) -> str:
    """How far ``other``'s greedy completions stray from ``base``'s: identical ones, the first
    differing token, and the logprobs' difference over the tokens before it."""
    firsts, deltas = [], []
    for a, b in zip(base, other, strict=True):
        pairs = list(zip(a, b, strict=True))  # both of 128 tokens (ignore_eos)
        first = next((i for i, (x, y) in enumerate(pairs) if x[0] != y[0]), len(pairs))
        firsts.append(first)
        deltas += [abs(x[1] - y[1]) for x, y in pairs[:first]]
    same = sum(f == len(a) for f, a in zip(firsts, base, strict=True))
    firsts.sort()
    mean, most = sum(deltas) / max(len(deltas), 1), max(deltas, default=0.0)
    return (f"{same}/{len(base)} completions identical over 128 tokens; first differing token "
            f"p50 {firsts[len(firsts) // 2]}, min {firsts[0]}; mean |logprob difference| over "
            f"the tokens before it {mean:.4f} (max {most:.4f})")  # fmt: skip


def kill_rank(rank: int) -> None:
    """SIGKILL to the processes of tensor-parallel rank ``rank`` (``compute.loop.rank``)."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"compute.loop.rank" in argv and argv[argv.index(b"--rank") + 1] == str(rank).encode():
            os.kill(int(entry.name), signal.SIGKILL)
            print(f"killed rank {rank} (pid {entry.name})", flush=True)


def server_shape(run: str) -> tuple[int, int]:
    """``run``'s worker groups and their ranks: ``tpN`` (and ``tpN-nccl``) one group of N,
    ``dpMxtpN`` M groups of N (one pool each, routed by the gateway)."""
    match = re.fullmatch(r"(?:dp(\d+)x)?tp(\d+)(?:-nccl)?", run)
    if match is None:
        raise SystemExit(f"--only: unknown server {run!r} (tpN, tpN-nccl or dpMxtpN)")
    return int(match.group(1) or 1), int(match.group(2))


def serve_runs(args: argparse.Namespace, run: str, model_dir: Path) -> dict[str, Any]:
    """One server's start-up, warm-up, drift sample and timed runs."""
    groups, size = server_shape(run)
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(groups * size))}
    up_args: tuple[str, ...] = ("--tensor-parallel-size", str(size)) if size > 1 else ()
    up_args += ("--data-parallel-size", str(groups)) if groups > 1 else ()
    out = args.out / f"{args.shape}-{run}"
    started = time.monotonic()
    with pagedserve_up(
        str(model_dir),
        args.out / f"redis-{run}",
        kvstore_args=f"--kv-memory {args.kv_memory}",
        gateways=args.gateways,
        up_args=up_args,
        env_extra=env,
        compute_args="--tp-all-reduce nccl" if run.endswith("-nccl") else "",
    ) as url:
        result: dict[str, Any] = {"startup_s": time.monotonic() - started, "runs": {}}
        print(f"{run}: healthy {result['startup_s']:.1f} s after `pagedserve up`", flush=True)
        warm_up(url, model_dir.name, model_dir, out, ignore_eos=True)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        result["sample"] = greedy_sample(url, model_dir.name, args.drift_requests, vocab)
        if run == "tp1" and args.drift_requests:  # bf16's own drift: other batches, other sums
            again = greedy_sample(url, model_dir.name, args.drift_requests, vocab, threads=4)
            print(f"bf16 drift, tp1 at 4 requests at a time against 32: "
                  f"{drift(result['sample'], again)}", flush=True)  # fmt: skip
        for name in args.runs:
            flags: tuple[str, ...] = {"sharegpt": SHAREGPT}.get(name, ())
            if name.startswith("c"):
                flags = ("--max-concurrency", name[1:])
            if name == "kill" and (size == 1 or not args.kill_rank_after):
                continue
            requests = 4 * int(name[1:]) if name.startswith("c") else args.requests
            killer = None
            if name == "kill":
                requests //= 2
                killer = threading.Timer(args.kill_rank_after, kill_rank, (1,))
                killer.start()
            before, busy_before, start = timelines(url), kvstore_busy(url), time.monotonic()
            path = out.with_suffix(f".{name}.json")
            timed = bench(url, model_dir.name, model_dir, requests, path, True, workload=flags)
            wall = time.monotonic() - start  # the client's span leaves out its prompt building
            span = min(timed["duration_s"], wall) or wall
            busy = busy_delta(busy_before, kvstore_busy(url), span)
            print(f"{run} {name} kvstore busy, s/s: {busy}", flush=True)
            if killer is not None:
                killer.cancel()
            time.sleep(TIMELINE_WAIT_S)
            timed["steps"] = timeline_delta(before, timelines(url))
            print(f"{run} {name}: {row(name, timed)} GPU {timed['gpu']}", flush=True)
            print(f"{run} {name} worker steps: {timed['steps']}", flush=True)
            result["runs"][name] = timed
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["1b", "8b", "70b"], default="8b")
    parser.add_argument(
        "--only",
        default="tp1,tp2",
        help="servers in order: tpN (a group of N ranks; small all-reduces one-shot over "
        "NVLink), tpN-nccl (all of them by NCCL), dpMxtpN (M groups of N ranks on M*N GPUs)",
    )
    parser.add_argument("--requests", type=int, default=1000, help="the burst's")
    parser.add_argument(
        "--runs",
        default="c32,burst",
        help="timed runs in order: cN (N requests in flight, 4N requests), burst, sharegpt, "
        "kill (TP > 1, with --kill-rank-after); '': the drift sample only",
    )
    parser.add_argument("--drift-requests", type=int, default=64)
    parser.add_argument("--kv-memory", default="auto", help="the kvstore's --kv-memory per pool")
    parser.add_argument("--gateways", type=int, default=2, help="gateway processes")
    parser.add_argument(
        "--kill-rank-after", type=float, default=0.0, help="seconds into the kill run (0: none)"
    )
    parser.add_argument(
        "--checkpoint-dirs",
        default="",
        help="write the checkpoint shard by shard (bench/big_checkpoint.py) over these "
        "directories, the first holding the checkpoint (the others' files linked into it)",
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/pagedserve-tp"))
    args = parser.parse_args()
    args.runs = [run for run in args.runs.split(",") if run]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.checkpoint_dirs:
        from bench.big_checkpoint import write_checkpoint
        from bench.shapes import SHAPES

        dirs = [Path(d) for d in args.checkpoint_dirs.split(",")]
        model_dir = write_checkpoint(SHAPES[args.shape](), dirs)
    else:
        model_dir = checkpoint(args.out / f"model-{args.shape}", args.shape)
    results = {run: serve_runs(args, run, model_dir) for run in args.only.split(",")}
    rows = ["| server | run | completed | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
            "TPOT p50 ms |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for run, result in results.items():
        rows += [row(f"{run} | {name}", timed) for name, timed in result["runs"].items()]
        print(f"{run}: start-up {result['startup_s']:.1f} s")
    for server, two in results.items():
        if "tp1" not in results or server == "tp1":
            continue
        one = results["tp1"]
        for name in set(one["runs"]) & set(two["runs"]):
            a, b = one["runs"][name], two["runs"][name]
            print(f"{name}: {server} ITL p50 {b['itl_ms']['p50'] / a['itl_ms']['p50']:.2f}x "
                  f"tp1's, output tok/s {b['output_tok_s'] / a['output_tok_s']:.2f}x")  # fmt: skip
        print(f"bf16 drift, {server} against tp1: {drift(one['sample'], two['sample'])}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
