"""How many streamed tokens per second one gateway process delivers, and its CPU per token.

A real ``pagedserve gateway`` (tiny's tokenizer, a CPU kvstore for its capacity) in front of an
instant batch worker: a separate process speaking the Redis contract (``contracts.queue_worker``,
no model) that, like an engine of ``--step-ms`` per step, publishes one token for every request
it holds each step, in one pipelined round trip. ``pagedserve bench`` fires ``--requests``
streamed chat completions at once (``max_tokens`` ``--tokens`` each). Reported: the client's
output tok/s and TPOT, and the gateway processes' CPU seconds per delivered token (from
/proc): the per-token cost of the HTTP stack, whatever the machine's core count. Every process
shares the machine's cores, so on a small machine the throughput is a lower bound.
``--gateways N``: N gateway processes on one port (``--reuse-port``, metrics shared through
``PROMETHEUS_MULTIPROC_DIR``), as ``pagedserve up --gateways N`` runs them.

    python bench/gateway_throughput.py [--requests 128] [--tokens 256] [--step-ms 2] [--gateways 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from contracts import queue_worker
from contracts.records import OutputRecord, RequestRecord
from gateway.metrics import MULTIPROC_ENV
from pagedserve.procs import spawn_kvstore, spawn_process
from pagedserve.redis_server import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parent.parent


def instant_engine(url: str, step_s: float, stop: Connection) -> None:
    """Every ``step_s``: take new requests, publish one token ("a") for each one held, the last
    one final, ack the finished."""
    r = redis.Redis.from_url(url)
    queue_worker.ensure_group(r)
    held: dict[str, tuple[str, RequestRecord, int]] = {}  # req_id -> (entry, record, sent)
    while not stop.poll():
        started = time.perf_counter()
        for entry_id, record in queue_worker.read_requests(r, "instant", 512, None):
            held[record.req_id] = (entry_id, record, 0)
        records, acks = [], []
        for req_id, (entry_id, record, sent) in list(held.items()):
            final = sent + 1 >= record.params.max_tokens
            records.append(
                OutputRecord(
                    req_id,
                    0,
                    [97],
                    "length" if final else None,
                    prompt_tokens=len(record.prompt_token_ids),
                    final=final,
                    text="a",
                    offset=sent,
                )
            )
            if final:
                acks.append(entry_id)
                del held[req_id]
            else:
                held[req_id] = (entry_id, record, sent + 1)
        if records:
            queue_worker.step(r, records, acks)
        time.sleep(max(0.0, step_s - (time.perf_counter() - started)))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--gateways", type=int, default=1, help="processes on one port")
    parser.add_argument("--input-len", default="16:64", help="prompt tokens, min:max")
    args = parser.parse_args()
    server = EmbeddedRedis.start()
    endpoint = f"ipc:///tmp/pagedserve-gw-bench-{os.getpid()}.sock"
    flags = ["--model", "tiny", "--device", "cpu", "--kv-memory", "0.5", "--log-level", "WARNING"]
    kvstore = spawn_kvstore(endpoint, flags)
    stop_rx, stop_tx = mp.Pipe(duplex=False)
    engine = mp.Process(target=instant_engine, args=(server.url, args.step_ms / 1e3, stop_rx))
    engine.start()
    port = free_port()
    flags = ["--model", "tiny", "--redis-url", server.url, "--kvstore", endpoint]
    flags += ["--port", str(port), *(["--reuse-port"] if args.gateways > 1 else [])]
    shared = tempfile.mkdtemp(prefix="pagedserve-metrics-")
    env = {**os.environ, **({MULTIPROC_ENV: shared} if args.gateways > 1 else {})}  # as `up`
    gateways = [
        spawn_process(
            "gateway", flags, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for _ in range(args.gateways)
    ]
    try:
        time.sleep(3)  # the gateway binds
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            command = [sys.executable, "-m", "pagedserve.cli", "bench", "--base-url"]
            command += [f"http://127.0.0.1:{port}", "--model", "tiny", "--endpoint", "chat"]
            command += ["--tokenizer", "tiny", "--num-requests", str(args.requests)]
            command += [
                "--input-len",
                args.input_len,
                "--output-len",
                f"{args.tokens}:{args.tokens}",
            ]
            command += ["--result-json", str(out), "--no-progress"]
            warm = [*command, "--num-requests", "16"]  # the gateway's lazy loads, untimed
            subprocess.run(warm, cwd=ROOT, timeout=600, capture_output=True)
            before = sum(cpu_seconds(g.pid) for g in gateways)
            done = subprocess.run(command, cwd=ROOT, timeout=600, capture_output=True, text=True)
            if done.returncode != 0 or not out.exists():
                raise SystemExit(f"pagedserve bench failed:\n{done.stderr[-3000:]}")
            spent = sum(cpu_seconds(g.pid) for g in gateways) - before
            result = json.loads(out.read_text())
    finally:
        stop_tx.send(True)
        engine.join(10)
        for gateway in gateways:
            gateway.send_signal(2)
            gateway.wait(30)
        shutil.rmtree(shared, ignore_errors=True)
        kvstore.send_signal(2)
        kvstore.wait(30)
        server.stop()
    if result["failed"]:
        print(f"{result['failed']} requests failed: {result['errors']}")
    tokens = result["output_tokens"]
    if not tokens:
        raise SystemExit(f"no token came back: {result['failed']} failed, {result['errors'][:3]}")
    print(
        f"{result['completed']}/{args.requests} requests, {tokens} tokens, "
        f"{result['output_tok_s']:.0f} out tok/s through the gateway (engine step "
        f"{args.step_ms} ms: {args.requests / args.step_ms * 1e3:.0f} tok/s offered; "
        f"{args.gateways} gateway process(es)), TTFT p50 {result['ttft_ms']['p50']:.0f} ms, "
        f"TPOT p50 {result['tpot_ms']['p50']:.2f} ms, "
        f"ITL p50 / p99 {result['itl_ms']['p50']:.2f} / {result['itl_ms']['p99']:.1f} ms; "
        f"gateway CPU {spent:.2f} s = "
        f"{spent / tokens * 1e6:.1f} us per token (one core: at most "
        f"{tokens / spent if spent else 0:.0f} tok/s)"
    )


if __name__ == "__main__":
    main()
