"""N GPUs behind one endpoint, over HTTP with `pagedserve bench`, against one GPU and against
what a user does today (N independent one-GPU stacks behind a round-robin proxy), on the random
burst of ``bench/http_serve.py`` (chat, prompts 64-1024 tokens, ``max_tokens`` 32-512, greedy,
``ignore_eos``), one run each, in one lease (``--gpus N``, 2 by default):

- ``one``: ``pagedserve up`` on GPU 0 (``CUDA_VISIBLE_DEVICES=0``);
- ``dp`` (or ``dp:POLICY``; ``two`` is its old name): ``pagedserve up --data-parallel-size N``
  (one kvstore owning every pool, a worker per GPU, the gateway routing each request,
  ``--routing`` as given);
- ``stacks`` (``pair``): N ``pagedserve up`` (GPU 0 .. N-1) and ``bench/round_robin_proxy.py``
  in front, the same client driving the proxy.

Every server first gets 32 untimed warm-up requests (another seed). Each stack runs
``--gateways-per-gpu`` gateway processes per GPU (4; one gateway process streams ~20-30k tok/s
of the 1B shape, so fewer would measure the gateways, not the GPUs).

    python bench/multi_gpu.py --shape 1b --requests 1000 [--gpus 4] [--only one,dp,stacks]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
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
    wait_http,
    warm_up,
)
from bench.shapes import checkpoint  # noqa: E402
from pagedserve.procs import interrupt  # noqa: E402
from pagedserve.redis_server import free_port  # noqa: E402

KINDS = (  # (kind, what its command line holds), first match wins
    ("redis", "redis-server"),
    ("gateway", " gateway"),
    ("worker", " compute"),
    ("kvstore", " kvstore"),
    ("client", " bench"),
    ("proxy", "round_robin_proxy"),
)


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far of the stack's processes on this host, by kind."""
    ticks = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kind = next((k for k, marker in KINDS if marker in cmdline), None)
        if kind is not None and ("pagedserve" in cmdline or kind in ("redis", "proxy")):
            totals[kind] = totals.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return totals


@contextlib.contextmanager
def proxy(upstreams: list[str]) -> Iterator[str]:
    """``bench/round_robin_proxy.py`` in front of ``upstreams``; its URL once it answers."""
    port = free_port()
    command = [sys.executable, "bench/round_robin_proxy.py", "--port", str(port)]
    for upstream in upstreams:
        command += ["--upstream", upstream]
    process = subprocess.Popen(command, cwd=ROOT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", process, 60, ok=True)
        yield f"http://127.0.0.1:{port}"
    finally:
        interrupt(process)


def enter_together(stack: contextlib.ExitStack, managers: list[Any]) -> list[Any]:
    """``managers`` entered at once (stacks start side by side, not one after another), each one
    that entered left on ``stack``; the first failure raised once all tried."""
    with ThreadPoolExecutor(len(managers)) as pool:
        futures = [pool.submit(manager.__enter__) for manager in managers]
    for manager, future in zip(managers, futures, strict=True):
        if future.exception() is None:
            stack.push(manager)
    return [future.result() for future in futures]


def timed(
    url: str,
    model_dir: Path,
    requests: int,
    out: Path,
    admin_urls: list[str],
    processes: int = 1,
    workload: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Warm-up, then the timed run; the workers' step timelines over it (``admin_urls``: the
    stacks' own URLs, whose admin API the token of ``pagedserve_up`` opens)."""
    warm_up(url, model_dir.name, model_dir, out, ignore_eos=True)
    before = [timelines(u) for u in admin_urls]
    busy_before = [kvstore_busy(u) for u in admin_urls]
    cpu_before, start = cpu_seconds(), time.monotonic()
    result = bench(
        url,
        model_dir.name,
        model_dir,
        requests,
        out,
        ignore_eos=True,
        processes=processes,
        workload=workload,
    )
    wall, cpu_after = time.monotonic() - start, cpu_seconds()
    # over the client's own span (its requests' first start to last end): the client first
    # builds its prompts, seconds in which the stack idles
    span = min(result["duration_s"], wall) or wall
    busy = {k: (v - cpu_before.get(k, 0.0)) / span for k, v in sorted(cpu_after.items())}
    print(
        f"{out.stem} CPU cores busy over the client's {span:.1f} s of {wall:.1f} s: "
        + ", ".join(f"{k} {v:.2f}" for k, v in busy.items())
    )
    for b, u in zip(busy_before, admin_urls, strict=True):
        print(f"{out.stem} kvstore {u} busy, s/s: {busy_delta(b, kvstore_busy(u), span)}")
    time.sleep(TIMELINE_WAIT_S)
    steps = [timeline_delta(b, timelines(u)) for b, u in zip(before, admin_urls, strict=True)]
    print(f"{out.stem}: {result['output_tok_s']:.0f} out tok/s; GPU {result['gpu']}", flush=True)
    print(f"{out.stem} by pool: {per_pool(result)}", flush=True)
    print(f"{out.stem} worker step timelines: {'; '.join(steps)}", flush=True)
    return result


def per_pool(result: dict[str, Any]) -> str:
    """Each serving pool's share of a run (``X-PagedServe-Pool`` of each response): requests,
    prompt and output tokens, and when its last request ended (seconds after the first start),
    which says whether one pool's load set the run's end."""
    requests = [r for r in result["requests"] if r["error"] is None]
    if not requests:
        return "no request completed"
    start = min(r["start_s"] for r in requests)
    pools: dict[str, list[dict[str, Any]]] = {}
    for r in requests:
        pools.setdefault(r["server_pool"] or "?", []).append(r)
    return "; ".join(
        f"pool {pool}: {len(rs)} requests, {sum(r['prompt_tokens'] for r in rs)} prompt and "
        f"{sum(r['output_tokens'] for r in rs)} output tokens, last end "
        f"{max(r['end_s'] for r in rs) - start:.1f} s"
        for pool, rs in sorted(pools.items())
    )


def popularity(zipf: float) -> str:
    """``--prefix-popularity`` of ``--zipf`` (0: the prefixes in turn)."""
    return f"zipf:{zipf}" if zipf > 0 else "uniform"


def workload_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The ``pagedserve bench`` flags of ``--workload`` (none: the random burst)."""
    if args.workload == "tenants":
        return (
            "--workload", "shared-prefix", "--num-prefixes", str(args.prefixes),
            "--prefix-len", args.prefix_len, "--prefix-popularity", popularity(args.zipf),
            "--input-len", "64:512", "--output-len", args.output_len,
            "--request-rate", str(args.rate),
        )  # fmt: skip
    if args.workload == "conversations":
        return (
            "--workload", "multi-turn", "--conversations", str(args.requests // args.turns),
            "--turns", str(args.turns), "--first-prompt-len", args.prefix_len,
            "--turn-prompt-len", "64:512", "--output-len", args.output_len,
            "--request-rate", str(args.rate), "--think-time-s", str(args.think_time_s),
        )  # fmt: skip
    return ()


def ideal_hit_rate(args: argparse.Namespace, model_dir: Path) -> float:
    """The tenants workload's prefix-hit rate with a pool holding every prefix (one GPU with
    room for everything), estimated: every use of a prefix after its first hits its whole
    blocks (the chat template's few tokens left out), over the prompts' tokens."""
    from contracts.tokenizer import load_tokenizer
    from pagedserve.bench import requests_of
    from pagedserve.bench_config import BenchConfig
    from pagedserve.bench_workloads import prefix_picks

    config = BenchConfig(
        workload="shared-prefix", num_requests=args.requests, input_len="64:512",
        output_len=args.output_len, prefix_len=args.prefix_len, num_prefixes=args.prefixes,
        prefix_popularity=popularity(args.zipf), tokenizer=str(model_dir),
    )  # fmt: skip
    prompts = [group[0].text for group in requests_of(config)]
    picks = prefix_picks(args.requests, args.prefixes, args.zipf or None, config.seed)
    tokenizer = load_tokenizer(str(model_dir))
    hits = 0
    for prefix in set(picks):
        uses = [prompts[i] for i, p in enumerate(picks) if p == prefix]
        if len(uses) > 1:
            common = os.path.commonprefix(uses)  # noqa: RUF071 (text, not paths)
            shared = len(tokenizer.encode(common, add_special_tokens=False))
            hits += (len(uses) - 1) * (shared // 16 * 16)
    total = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    return hits / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["1b", "8b"], default="1b")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=Path("/tmp/pagedserve-multi-gpu"))
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of runs dp and stacks")
    parser.add_argument("--routing", default="prefix", help="the gateway's --routing for run dp")
    parser.add_argument(
        "--only",
        default="one,dp,stacks",
        help="which runs, in order: one, dp (or dp:POLICY, e.g. dp:round_robin), stacks",
    )
    parser.add_argument(
        "--workload",
        choices=["random", "tenants", "conversations"],
        default="random",
        help="random: the burst; tenants: --prefixes system prompts of --prefix-len tokens, "
        "Zipf --zipf popularity, 64-512-token questions, Poisson --rate; conversations: "
        "--requests/--turns multi-turn conversations opening with --prefix-len tokens",
    )
    parser.add_argument("--prefixes", type=int, default=256)
    parser.add_argument("--prefix-len", default="2048:6144")
    parser.add_argument(
        "--zipf", type=float, default=0.8, help="prefix popularity (0: the prefixes in turn)"
    )
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--think-time-s", type=float, default=0.0, help="conversations' pause")
    parser.add_argument("--output-len", default="32:128")
    parser.add_argument(
        "--kv-memory",
        default="auto",
        help="every kvstore's --kv-memory (per pool): a fixed size in GiB makes the pools of "
        "two machine kinds alike",
    )
    parser.add_argument("--rate", type=float, default=30.0, help="requests (conversations) / s")
    parser.add_argument(
        "--gateways-per-gpu",
        type=int,
        default=4,
        help="gateway processes per GPU of each stack (one gateway streams ~20-30k tok/s)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="`pagedserve bench --processes`: client processes sending the same requests "
        "(one may not keep up with two GPUs of the 1B shape)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = checkpoint(args.out / f"model-{args.shape}", args.shape)
    flags = workload_flags(args)
    rows = ["| server | completed | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
            "TPOT p50 ms | prefix hit |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    model = str(model_dir)
    kv_args = f"--kv-memory {args.kv_memory}"

    def run_on(url: str, out: Path, admin_urls: list[str]) -> dict[str, Any]:
        return timed(url, model_dir, args.requests, out, admin_urls, args.client_processes, flags)

    for run in args.only.split(","):
        out = args.out / f"{args.shape}-{args.workload}-{run.replace(':', '-')}.json"
        if run == "one":
            gpu0 = {"CUDA_VISIBLE_DEVICES": "0"}
            with pagedserve_up(
                model,
                args.out / "redis-one",
                kvstore_args=kv_args,
                gateways=args.gateways_per_gpu,
                env_extra=gpu0,
            ) as url:
                results[run] = run_on(url, out, [url])
            name = "one GPU"
        elif run.startswith(("dp", "two")):
            routing = run.partition(":")[2] or args.routing
            up_args: tuple[str, ...] = ("--data-parallel-size", str(args.gpus))
            up_args += (f"--gateway-args=--routing {routing}",)
            gateways = args.gpus * args.gateways_per_gpu
            with pagedserve_up(
                model,
                args.out / "redis-dp",
                kvstore_args=kv_args,
                gateways=gateways,
                up_args=up_args,
            ) as url:
                results[run] = run_on(url, out, [url])
            name = f"{args.gpus} GPUs, one endpoint (--routing {routing})"
        elif run in ("stacks", "pair"):
            with contextlib.ExitStack() as stack:
                ups = [
                    pagedserve_up(
                        model,
                        args.out / f"redis-stack{gpu}",
                        kvstore_args=kv_args,
                        gateways=args.gateways_per_gpu,
                        env_extra={"CUDA_VISIBLE_DEVICES": str(gpu)},
                    )
                    for gpu in range(args.gpus)
                ]
                urls = enter_together(stack, ups)
                results[run] = run_on(stack.enter_context(proxy(urls)), out, urls)
            name = f"{args.gpus} one-GPU stacks + round-robin proxy"
        else:
            raise SystemExit(f"--only: unknown run {run!r}")
        rows.append(row(name, results[run]) + f" {results[run]['cached_fraction']:.3f} |")
    for base_run in ("one", "dp:round_robin", "two:round_robin"):
        if base_run in results:
            base = results[base_run]
            for run, result in results.items():
                ratio = result["output_tok_s"] / base["output_tok_s"]
                ttft = base["ttft_ms"]["p99"] / max(result["ttft_ms"]["p99"], 1e-9)
                print(f"{run}: {ratio:.2f}x {base_run}'s tok/s; TTFT p99 {ttft:.2f}x lower")
    if args.workload == "tenants":
        ideal = ideal_hit_rate(args, model_dir)
        print(f"prefix hit rate with a pool holding every prefix (estimate): {ideal:.3f}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
