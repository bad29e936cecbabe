"""Where a tensor-parallel decode step's time goes, without the server around it: the shape's model
with uninitialized bf16 weights (no checkpoint: shard by shard on the meta device, then
allocated on each rank's GPU), the fused forwards, a zeroed pool; rank 0's ``ModelRunner`` with
decode graphs runs steps of one token for each of ``--batch`` requests whose contexts start at
``--context`` tokens (block tables laid out directly, no prefill), the other ranks following.

Per step on rank 0: ``forward``, the CUDA-event time of ``ModelRunner.forward`` (the graph's
replay, its all-reduces waiting for the other ranks included); ``step``, the wall time of the
forward and the greedy tokens' copy to the host (what a step costs an engine that waits for
it). p50 over ``--steps`` after 10; TP=1 and TP=2 in turn, each in fresh processes.

    python bench/tp_step.py --shape 8b [--batch 32,256] [--context 512] [--profile-steps 5]

``--profile-steps N`` then runs N more steps of each batch under the torch profiler and prints
rank 0's device time per kernel (``bench/device_window.py``'s report; the engine's own count
there is left at 0): where a TP=2 step's time goes against TP=1's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.shapes import SHAPES  # noqa: E402
from compute.model.attention import ATTN_NAME  # noqa: E402
from compute.model.models import fuse_on_cuda  # noqa: E402
from compute.model.runner import ModelRunner, ScheduledChunk  # noqa: E402
from compute.parallel.group import free_port, join_group  # noqa: E402
from compute.parallel.layers import TPGroup  # noqa: E402
from compute.parallel.sharding import shard_model  # noqa: E402
from contracts.model_config import kv_geometry  # noqa: E402

BLOCK = 16
WARM = 10


def empty_model(shape: str, device: str, group: TPGroup | None) -> Any:
    """The shape's model (this rank's shards in a group), weights allocated, not initialized."""
    config = SHAPES[shape]()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation=ATTN_NAME
        )
    if group is not None:
        shard_model(model, group, device=device, dtype=torch.bfloat16)
    model.to_empty(device=device)
    with torch.device(device):  # the rotary frequencies: computed, not loaded
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    model.eval()
    fuse_on_cuda(model)
    return model


def decode_chunks(tables: list[list[int]], batch: int, position: int) -> list[ScheduledChunk]:
    """One decode step of ``batch`` requests: a token each at ``position``, over their tables."""
    return [ScheduledChunk([7], position, tables[i], key=f"b{batch}-{i}") for i in range(batch)]


def run(rank: int, size: int, port: int, args: argparse.Namespace, out: str) -> None:
    device = f"cuda:{rank}"
    torch.cuda.set_device(rank)
    group = None
    if size > 1:
        group = join_group(rank, size, f"tcp://127.0.0.1:{port}", device, 120.0, args.all_reduce)
    model = empty_model(args.shape, device, group)
    batches = [int(b) for b in args.batch.split(",")]
    per_seq = -(-(args.context + WARM + args.steps + args.profile_steps + 1) // BLOCK)
    geo = kv_geometry(model.config, "bfloat16", size)
    shape = (per_seq * max(batches), geo.num_layers, 2, BLOCK, geo.num_kv_heads, geo.head_dim)
    pool = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    runner = ModelRunner(model, pool, BLOCK, max(batches), 0, group=group)
    if rank:
        runner.follow()
        os._exit(0)  # NCCL communicators a graph captured are left to the exit
    results: dict[str, Any] = {}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for batch in batches:
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        forwards, steps = [], []
        for step in range(WARM + args.steps):
            chunks = decode_chunks(tables, batch, args.context + step)
            torch.cuda.synchronize()
            clock = time.perf_counter()
            start.record()
            logits = runner.forward(chunks)
            end.record()
            logits.argmax(-1).tolist()
            wall = time.perf_counter() - clock
            if step >= WARM:
                forwards.append(start.elapsed_time(end))
                steps.append(1e3 * wall)
        results[str(batch)] = {
            "forward_ms": statistics.median(forwards),
            "step_ms": statistics.median(steps),
            "path": runner.last_path,
            "profile": profiled(runner, tables, batch, args) if args.profile_steps else [],
        }
    runner.stop_followers()
    Path(out).write_text(json.dumps(results))
    os._exit(0)


def profiled(
    runner: ModelRunner, tables: list[list[int]], batch: int, args: argparse.Namespace
) -> list[str]:
    """``--profile-steps`` more steps under the torch profiler (CUDA activity of rank 0: its
    kernels, the all-reduces' waits for the other ranks inside them): ``device_window``'s
    report of them, the device time per kernel name first."""
    from torch.profiler import ProfilerActivity, profile

    from bench.device_window import report

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for step in range(args.profile_steps):
            chunks = decode_chunks(tables, batch, args.context + WARM + args.steps + step)
            runner.forward(chunks).argmax(-1).tolist()
        torch.cuda.synchronize()
    spans = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in trace.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
    ]
    return report(spans, 0.0, args.profile_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--batch", default="32,256", help="requests per step, comma-separated")
    parser.add_argument("--context", type=int, default=512, help="tokens before the first step")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per batch size")
    parser.add_argument("--sizes", default="1,2", help="group sizes, in turn")
    parser.add_argument("--all-reduce", choices=["auto", "nccl"], default="auto")
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="then profile this many steps of each batch on rank 0 (kernel time by name)",
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/pagedserve-tp-step"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    table: dict[int, dict[str, Any]] = {}
    for size in (int(s) for s in args.sizes.split(",")):
        out = args.out / f"tp{size}.json"
        mp.spawn(run, (size, free_port(), args, str(out)), nprocs=size)
        table[size] = json.loads(out.read_text())
    print("| TP | batch | forward ms (GPU) | step ms (wall) | path |")
    print("|---|---|---|---|---|")
    for size, rows in table.items():
        for batch, r in rows.items():
            print(
                f"| {size} | {batch} | {r['forward_ms']:.2f} | {r['step_ms']:.2f} | {r['path']} |"
            )
    for size, rows in table.items():
        for batch, r in rows.items():
            for line in r["profile"]:
                print(f"TP={size} batch {batch}: {line}")
    if 1 in table and 2 in table:
        for batch in table[1]:
            one, two = table[1][batch], table[2][batch]
            print(f"batch {batch}: TP=2 forward {two['forward_ms'] / one['forward_ms']:.2f}x "
                  f"TP=1's, step {two['step_ms'] / one['step_ms']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
