"""A rank other than 0 of a tensor-parallel worker group: ``pagedserve compute
--tensor-parallel-size N`` (rank 0, the worker) starts one such process per other rank
(``python -m compute.loop.rank``). It joins the group, loads its shards of the checkpoint, and
runs what rank 0 sends (``compute.parallel.step_plan``): it maps its rank's pool of each pool
rank 0 maps and follows every forward and block copy on it, until rank 0 stops it. It talks to
neither the kvstore nor Redis; when rank 0 dies, its next collective fails and it exits, and
when it dies, rank 0's does (the group goes down together and restarts together)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from compute.model.models import load_sharded_model
from compute.model.runner import ModelRunner
from compute.parallel.group import free_port, join_group, leave_group
from compute.parallel.layers import TPGroup
from compute.parallel.step_plan import RunnerSettings, StepPlan, receive_plan, send_plan
from contracts import options
from kvstore.mapping import map_pool
from kvstore.protocol import PoolInfo

log = logging.getLogger("pagedserve.compute")
JOIN_TIMEOUT_S = 600.0  # the ranks' start-up (loading their shards) and any collective's wait


def build_runner(
    model: PreTrainedModel, info: PoolInfo, settings: RunnerSettings, group: TPGroup | None
) -> ModelRunner:
    """The runner over the kvstore's pool ``info`` (in a group: this rank's pool of it; rank 0
    first sends the other ranks the same ``map`` plan, so that they build theirs)."""
    ranked = group if group is not None and group.size > 1 else None
    size = ranked.size if ranked is not None else 1
    if len(info.ranks) != (size if size > 1 else 0):
        raise RuntimeError(
            f"the kvstore splits its pools over {len(info.ranks) or 1} rank(s), this worker runs "
            f"{size}: start both with the same --tensor-parallel-size"
        )
    if ranked is not None and ranked.rank == 0:
        send_plan(StepPlan("map", pool=info, settings=settings), ranked, model.device)
    pool = map_pool(info.ranks[ranked.rank] if ranked is not None else info)
    if pool.device.type != model.device.type:
        raise RuntimeError(
            f"the kvstore's pool is on {pool.device.type}, the model on "
            f"{model.device.type}: start both on the same device"
        )
    return ModelRunner(
        model,
        pool,
        settings.block_size,
        settings.cuda_graph_max_batch,
        settings.cuda_graph_max_tokens,
        settings.max_chunks,
        group=group,
    )


def serve_rank(model: PreTrainedModel, group: TPGroup, device: str) -> None:
    """Runs rank 0's plans on this rank until ``stop``."""
    plan: StepPlan = receive_plan(group, torch.device(device))
    while plan.kind != "stop":
        if plan.kind != "map" or plan.pool is None or plan.settings is None:
            raise RuntimeError(f"rank {group.rank}: a {plan.kind!r} plan before any pool")
        runner = build_runner(model, plan.pool, plan.settings, group)
        log.info("rank %d mapped its pool %s", group.rank, list(runner.pool.shape))
        plan = runner.follow()
    log.info("rank %d stopped", group.rank)


@dataclass
class Group:
    """Rank 0's view of its group: its place in it and the other ranks' processes."""

    group: TPGroup
    ranks: list[subprocess.Popen[bytes]]

    def stop(self, runner: ModelRunner | None) -> None:
        """Stops the other ranks (``stop``, else SIGTERM after 10 s) and leaves the group."""
        if runner is not None:
            with contextlib.suppress(Exception):  # a rank that died already: nothing to stop
                runner.stop_followers()
        for process in self.ranks:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.terminate()
        leave_group()


def start_group(model: str, dtype: str, device: str, size: int, log_level: str) -> Group:
    """Rank 0 (this worker): starts ranks 1 to ``size - 1`` (``python -m compute.loop.rank``,
    rank r on the r-th GPU after ``device``'s; on CPU all on the CPU) and joins the group with
    them on a free local port."""
    port = free_port()
    init = f"tcp://127.0.0.1:{port}"
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    ranks = []
    for rank in range(1, size):
        command = [sys.executable, "-m", "compute.loop.rank", "--rank", str(rank)]
        command += ["--size", str(size), "--init", init, "--model", model, "--dtype", dtype]
        command += ["--device", rank_device(device, rank), "--log-level", log_level]
        ranks.append(subprocess.Popen(command, env=env))
    log.info("started ranks 1 to %d of the tensor-parallel group", size - 1)
    return Group(join_group(0, size, init, device, JOIN_TIMEOUT_S), ranks)


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device when rank 0's is ``device``: the ``rank``-th GPU after it."""
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--init", required=True, help="rank 0's tcp://host:port")
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True, help="as the worker's --dtype")
    parser.add_argument("--device", required=True)
    parser.add_argument("--timeout-s", type=float, default=JOIN_TIMEOUT_S)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    options.configure_logging(args.log_level)
    group = join_group(args.rank, args.size, args.init, args.device, args.timeout_s)
    try:
        model, _ = load_sharded_model(args.model, args.dtype, args.device, group)
        serve_rank(model, group, args.device)
    finally:
        leave_group()


if __name__ == "__main__":
    main()
