"""A rank other than 0 of a tensor-parallel worker group: ``pagedserve compute
--tensor-parallel-size N`` (rank 0, the worker) starts one such process per other rank
(``python -m compute.loop.rank``). It joins the group, loads its shards of the checkpoint, and
runs what rank 0 sends (``compute.parallel.step_plan``): it maps its rank's pool of each pool
rank 0 maps and follows every forward and block copy on it, until rank 0 stops it. It talks to
neither the kvstore nor Redis. The group goes down together and restarts together: a rank gets
SIGKILL when rank 0 exits (``die_with_parent``), and rank 0 exits when a rank does
(``watch``), at once, not when its next collective times out (over NCCL a collective
waits for a dead peer until then)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel

from compute.model.models import load_sharded_model
from compute.model.profile import scratch_runner
from compute.model.runner import ModelRunner
from compute.parallel import ALL_REDUCES
from compute.parallel.group import free_port, join_group, leave_group
from compute.parallel.layers import TPGroup
from compute.parallel.step_plan import RunnerSettings, StepPlan, receive_plan, send_plan
from contracts import options
from contracts.heap import tune_gc_for_serving
from kvstore.mapping import map_pool
from kvstore.protocol import PoolInfo

log = logging.getLogger("pagedserve.compute")
JOIN_TIMEOUT_S = 600.0  # the ranks' start-up (loading their shards) and any collective's wait
WATCH_INTERVAL_S = 0.2  # how often rank 0 looks at the other ranks' processes
RANK_DIED = 70  # rank 0's exit status when another rank's process exited


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
        send_plan(StepPlan("map", pool=info, settings=settings), ranked)
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


def serve_rank(model: PreTrainedModel, group: TPGroup) -> None:
    """Runs rank 0's plans on this rank until ``stop``: a runner over each pool rank 0 maps, or
    over a scratch pool while rank 0 times forwards (the cost-model profile) until it
    releases it."""
    plan: StepPlan = receive_plan(group)
    while plan.kind != "stop":
        if plan.kind == "release":
            plan = receive_plan(group)  # the scratch runner is gone
            continue
        if plan.kind == "scratch" and plan.scratch is not None:
            runner = scratch_runner(model, plan.scratch, group)
        elif plan.kind == "map" and plan.pool is not None and plan.settings is not None:
            runner = build_runner(model, plan.pool, plan.settings, group)
            log.info("rank %d mapped its pool %s", group.rank, list(runner.pool.shape))
        else:
            raise RuntimeError(f"rank {group.rank}: a {plan.kind!r} plan before any pool")
        plan = runner.follow()
        del runner  # its pool and graphs, before the next one's
    log.info("rank %d stopped", group.rank)


@dataclass
class Group:
    """Rank 0's view of its group: its place in it and the other ranks' processes."""

    group: TPGroup
    ranks: list[subprocess.Popen[bytes]]
    stopping: threading.Event  # set by ``stop``: a rank's exit is no longer a failure

    def stop(self, runner: ModelRunner | None) -> None:
        """Stops the other ranks (``stop``, else SIGTERM after 10 s) and leaves the group."""
        self.stopping.set()
        if runner is not None:
            with contextlib.suppress(Exception):  # a rank that died already: nothing to stop
                runner.stop_followers()
        for process in self.ranks:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.terminate()
        leave_group()


def start_group(
    model: str, dtype: str, device: str, size: int, all_reduce: str, log_level: str
) -> Group:
    """Rank 0 (this worker): starts ranks 1 to ``size - 1`` (``python -m compute.loop.rank``,
    rank r on the r-th GPU after ``device``'s; on CPU all on the CPU) and joins the group with
    them on a free local port (``all_reduce``: ``join_group``'s)."""
    port = free_port()
    init = f"tcp://127.0.0.1:{port}"
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    ranks = []
    for rank in range(1, size):
        command = [sys.executable, "-m", "compute.loop.rank", "--rank", str(rank)]
        command += ["--size", str(size), "--init", init, "--model", model, "--dtype", dtype]
        command += ["--device", rank_device(device, rank), "--all-reduce", all_reduce]
        command += ["--log-level", log_level]
        ranks.append(subprocess.Popen(command, env=env))
    log.info("started ranks 1 to %d of the tensor-parallel group", size - 1)
    stopping = threading.Event()
    watch(ranks, stopping)  # a rank that fails to start fails rank 0's start-up at once
    joined = join_group(0, size, init, device, JOIN_TIMEOUT_S, all_reduce)
    return Group(joined, ranks, stopping)


def watch(ranks: list[subprocess.Popen[bytes]], stopping: threading.Event) -> None:
    """From now on, until ``stopping`` is set, exits this process (status ``RANK_DIED``) as
    soon as one of ``ranks`` exits, killing the others (a thread's; the worker's supervisor
    restarts the group, and the kvstore gives the worker's requests back to the queue)."""

    def run() -> None:
        while not stopping.wait(WATCH_INTERVAL_S):
            dead = [(r, p.returncode) for r, p in enumerate(ranks, 1) if p.poll() is not None]
            if dead and not stopping.is_set():
                log.error("rank(s) %s exited (status): the group goes down with them", dead)
                for process in ranks:
                    process.kill()
                logging.shutdown()
                os._exit(RANK_DIED)

    threading.Thread(target=run, name="rank-watch", daemon=True).start()


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device when rank 0's is ``device``: the ``rank``-th GPU after it."""
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"


def die_with_parent() -> None:
    """This process gets SIGKILL when its parent (rank 0) exits (Linux's parent-death signal);
    it exits now if the parent is gone already."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):  # not Linux: rank 0's exit ends it later
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent == 1 or os.getppid() != parent:
        os._exit(RANK_DIED)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--init", required=True, help="rank 0's tcp://host:port")
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True, help="as the worker's --dtype")
    parser.add_argument("--device", required=True)
    parser.add_argument("--timeout-s", type=float, default=JOIN_TIMEOUT_S)
    parser.add_argument("--all-reduce", choices=ALL_REDUCES, default="auto")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    options.configure_logging(args.log_level)
    die_with_parent()
    group = join_group(
        args.rank, args.size, args.init, args.device, args.timeout_s, args.all_reduce
    )
    try:
        model, _ = load_sharded_model(args.model, args.dtype, args.device, group)
        tune_gc_for_serving()  # as rank 0: a young collection per plan would cost milliseconds
        serve_rank(model, group)
    finally:
        leave_group()


if __name__ == "__main__":
    main()
