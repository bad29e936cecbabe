"""Joining a tensor-parallel group: ``torch.distributed`` over gloo on CPU (what CI tests) or NCCL
on CUDA, the same code either way."""

from __future__ import annotations

import datetime
import logging
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from compute.parallel.layers import TPGroup
from compute.parallel.plan_ring import PlanRing
from compute.parallel.symmetric import symmetric_all_reduce

__all__ = ["free_port", "join_group", "leave_group"]

log = logging.getLogger("pagedserve.compute")


def join_group(
    rank: int, size: int, init_method: str, device: str, timeout_s: float, all_reduce: str
) -> TPGroup:
    """Rank ``rank`` of ``size`` joins at ``init_method`` (``tcp://host:port``, rank 0's), within
    ``timeout_s`` (also the longest any collective may wait: a rank that dies shows as its
    peers' error at the latest then). On CUDA the rank's device becomes the current one. Rank 0's
    messages to the others go through a ring in shared memory (``TPGroup.plans``), and with
    ``all_reduce`` 'auto' small all-reduces on CUDA go one-shot over NVLink
    (``TPGroup.one_shot``)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device).index or 0)  # "cuda": the first visible
    path = ring_path(init_method)
    if rank == 0:
        path.unlink(missing_ok=True)  # a killed group's, on the port we hold now
        plans = PlanRing(path, size - 1, None, timeout_s=timeout_s)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout
    )
    if rank > 0:
        plans = PlanRing(path, size - 1, rank, timeout_s=timeout_s)
    dist.barrier()
    if rank == 0:
        plans.unlink()  # every rank has it mapped
    log.info("rank %d of %d joined the group at %s (%s)", rank, size, init_method, backend)
    one_shot = None
    if backend == "nccl" and all_reduce == "auto":
        one_shot = symmetric_all_reduce(dist.group.WORLD, device)
    return TPGroup(rank, size, plans=plans, one_shot=one_shot)


def ring_path(init_method: str) -> Path:
    """The plan ring's file for the group meeting at ``init_method``: in ``/dev/shm`` (the
    temporary directory where there is none)."""
    directory = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    name = init_method.removeprefix("tcp://").replace(":", "-").replace("/", "-")
    return directory / f"pagedserve-plans-{name}"


def leave_group() -> None:
    """Leaves the group: gloo's is destroyed; NCCL's communicators are left to the process's
    exit, because destroying (or aborting) one that a live CUDA graph captured hangs (seen on
    H200s, torch's ``destroy_process_group`` and ``_abort_process_group`` alike), and the
    runner's graphs live until the process ends."""
    if dist.is_initialized() and dist.get_backend() != "nccl":
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (rank 0's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
