"""What a step's plan costs to reach the other ranks of a tensor-parallel group: the host channel
the worker uses (``compute.parallel.plan_ring``) against an NCCL broadcast of
the packed bytes on the GPUs (the length, then the bytes, then a copy to the host). Two ranks on
two GPUs; rank 0 sends 300 plans of a decode step of ``--batch`` requests with 1k-token contexts
(64 blocks each), each block table as its change since the plan before (``TableMirror``: none),
rank 1 receives them; each path's time per plan, p50 and p99, measured on the receiver from the
sender's clock (both ranks start each plan at a barrier). First, on the host: one plan's
encoding and decoding, with whole tables (a sequence's first step) and with their changes.

An idle GPU is the NCCL path's best case: in the worker, the broadcast is queued behind the
rank's forward of the step before, so the plan reaches the host only when that has run.

    python bench/plan_broadcast.py [--batch 256]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compute.parallel.group import free_port, join_group, leave_group  # noqa: E402
from compute.parallel.layers import TPGroup  # noqa: E402
from compute.parallel.step_plan import (  # noqa: E402
    StepPlan,
    TableMirror,
    decode_plan,
    encode_plan,
    receive_plan,
    send_plan,
)

PLANS = 300


def plans_of(batch: int) -> tuple[StepPlan, StepPlan]:
    """A decode step's plan with whole tables, then the next one's (the same tables)."""
    steps = [
        ([1000 + i], 1000, list(range(64 * i, 64 * i + 64)), False, f"seq-{i}")
        for i in range(batch)
    ]
    mirror = TableMirror()
    return StepPlan("forward", mirror.plan(steps)), StepPlan("forward", mirror.plan(steps))


def over_nccl(plan: StepPlan | None, group: TPGroup, device: torch.device) -> StepPlan:
    """The plan as bytes broadcast on the GPUs (rank 0's ``plan``), back on the host."""
    if plan is not None:
        payload = encode_plan(plan)
        length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
        dist.broadcast(length, 0)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        dist.broadcast(data, 0)
        return plan
    length = torch.empty(1, dtype=torch.int64, device=device)
    dist.broadcast(length, 0)
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, 0)
    return decode_plan(data.cpu().numpy().tobytes())


def run(rank: int, port: int, batch: int) -> None:
    device = torch.device(f"cuda:{rank}")
    group = join_group(rank, 2, f"tcp://127.0.0.1:{port}", str(device), 120.0, "auto")
    try:
        plan = plans_of(batch)[1]
        size = len(encode_plan(plan))
        for name in ("plan ring", "nccl"):
            times = []
            for _ in range(PLANS):
                dist.barrier()
                started = time.perf_counter()
                if name == "nccl":
                    got = over_nccl(plan if rank == 0 else None, group, device)
                elif rank == 0:
                    send_plan(plan, group)
                    got = plan
                else:
                    got = receive_plan(group)
                times.append(time.perf_counter() - started)
                assert len(got.chunks) == batch
            if rank == 1:
                times.sort()
                p50, p99 = 1e6 * times[PLANS // 2], 1e6 * times[PLANS * 99 // 100]
                print(
                    f"{name}: {size / 1024:.0f} KiB plan of {batch} decodes, received in "
                    f"p50 {p50:.0f} us, p99 {p99:.0f} us",
                    flush=True,
                )
    finally:
        leave_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="decodes in the plan")
    args = parser.parse_args()
    for name, plan in zip(("whole tables", "changes"), plans_of(args.batch), strict=True):
        started = time.perf_counter()
        decoded = [decode_plan(encode_plan(plan)) for _ in range(20)]
        codec = (time.perf_counter() - started) / len(decoded)
        size = len(encode_plan(plan)) / 1024
        print(f"{name}: {size:.1f} KiB, encoded and decoded in {1e6 * codec:.0f} us")
    mp.spawn(run, (free_port(), args.batch), nprocs=2)


if __name__ == "__main__":
    main()
