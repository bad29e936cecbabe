"""A tensor-parallel group's all-reduce on two GPUs: NCCL against the one-shot all-reduce over
symmetric memory (``compute.parallel.symmetric``), as a decode step meets them: 64 in a row (the
8B shape's layers, two each) captured in one CUDA graph, per hidden size and token count; the
mean time of one all-reduce over 20 replays, after 3. Checks that both give the same sums.

    python bench/all_reduce.py [--hidden 4096,8192] [--tokens 1,32,256,1024,4096]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compute.parallel.group import free_port, join_group

IN_A_ROW, REPLAYS = 64, 20


def time_graph(reduce: object, x: torch.Tensor) -> float:
    """Microseconds per all-reduce of ``x`` by ``reduce``, 64 in a row in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            reduce(x)  # type: ignore[operator]
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(IN_A_ROW):
            reduce(x)  # type: ignore[operator]
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (REPLAYS * IN_A_ROW)


def run(rank: int, port: int, hiddens: list[int], tokens: list[int]) -> None:
    device = f"cuda:{rank}"
    group = join_group(rank, 2, f"tcp://127.0.0.1:{port}", device, 120.0, "auto")
    one_shot = group.one_shot
    assert one_shot is not None, "no one-shot all-reduce on these GPUs"

    def nccl(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    rows = []
    for hidden in hiddens:
        for n in tokens:
            x = torch.randn(n, hidden, device=device, dtype=torch.bfloat16) * (rank + 1)
            if one_shot.fits(x):
                same = torch.equal(nccl(x.clone()), one_shot(x))
                times = (time_graph(nccl, x.clone()), time_graph(one_shot, x))
            else:
                same, times = True, (time_graph(nccl, x.clone()), float("nan"))
            mib = x.numel() * 2 / 2**20
            rows.append(
                f"| {hidden} | {n} | {mib:.3f} | {times[0]:.1f} | {times[1]:.1f} | "
                f"{times[0] / times[1]:.2f} | {'yes' if same else 'NO'} |"
            )
    if rank == 0:
        print("| hidden | tokens | MiB | NCCL µs | one-shot µs | NCCL / one-shot | same sums |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(rows), flush=True)
    dist.barrier()
    os._exit(0)  # NCCL communicators a graph captured are left to the exit (compute.parallel.group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="4096,8192", help="hidden sizes, comma-separated")
    parser.add_argument("--tokens", default="1,8,32,64,128,256,512,1024,2048,4096")
    args = parser.parse_args()
    hiddens = [int(h) for h in args.hidden.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    if torch.cuda.device_count() < 2:
        sys.exit("needs two CUDA GPUs")
    mp.spawn(run, (free_port(), hiddens, tokens), nprocs=2)


if __name__ == "__main__":
    main()
