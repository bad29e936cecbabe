"""The cost sweep's rig: a worker's runner over a pool of the daemon's, a request's scattered
block table, and the concurrent decode batch; both paths of a point timed on it."""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

import compute.model.attention  # noqa: F401  (registers the "paged" attention function)
from compute.model.runner import ModelRunner, ScheduledChunk
from contracts.model_config import kv_geometry
from kvstore.cost_model import LinearCost, SwapCalibration
from kvstore.device import DevicePools
from kvstore.peer_copy import PeerCopier

BLOCK = 16


def prefill_steps(tokens: int, budget: int, decodes: int) -> list[int]:
    """Chunk sizes of the steps that prefill ``tokens`` of one request beside ``decodes``
    decodes (``Scheduler.schedule``: the decodes first, the chunk gets what the budget leaves)."""
    room = budget - decodes
    if room < 1:
        raise ValueError(f"budget {budget} leaves no room beside {decodes} decodes")
    return [min(room, tokens - done) for done in range(0, tokens, room)]


class Rig:
    """The worker's runner over the daemon's pool, a request's block table, the present batch."""

    def __init__(self, model: PreTrainedModel, args: argparse.Namespace) -> None:
        self.args, self.device = args, torch.device(args.device)
        cuda = self.device.type == "cuda"
        geometry = kv_geometry(model.config, str(model.dtype).removeprefix("torch."))
        request = -(-longest(args) // BLOCK)
        per_decode = -(-(args.decode_context + 1) // BLOCK)
        gpu_blocks = 1 + request + args.decodes * per_decode  # block 0: table padding
        cpu_blocks = max(*args.blocks, 64)  # 64: every size calibrate() times
        self.pools = DevicePools(geometry, BLOCK, gpu_blocks, cpu_blocks, args.device)
        if cuda:
            self.pools.pool.zero_()
        self.calibration: SwapCalibration | None = self.pools.calibrate()  # as the daemon does
        self.peer: DevicePools | None = None  # another GPU's pool, for the "peer" kind
        self.copy_line: LinearCost | None = None
        if "peer" in args.kinds:
            peer_device = "cuda:1" if cuda else "cpu"
            self.peer = DevicePools(geometry, BLOCK, max(*args.blocks, 256), 0, peer_device)
            self.copier = PeerCopier([self.pools, self.peer])
            self.copy_line = self.copier.calibrate(1, 0)  # as the daemon does, into this pool
        graphs = not args.eager and cuda
        pieces = min(args.graph_tokens, args.budget) if graphs else 0
        note("capturing CUDA graphs" if graphs else "building the runner")
        self.runner = ModelRunner(model, self.pools.pool, BLOCK, args.decodes * graphs, pieces)
        gen = random.Random(args.seed)
        self.table = gen.sample(range(1, 1 + request), request)  # scattered, as after churn
        vocab = model.config.get_text_config().vocab_size
        self.ids = [gen.randrange(vocab) for _ in range(request * BLOCK)]
        base = 1 + request
        tables = [
            range(base + d * per_decode, base + (d + 1) * per_decode) for d in range(args.decodes)
        ]
        self.decodes = [ScheduledChunk([1], args.decode_context, list(t)) for t in tables]
        self.decode_step_s = (
            self.median(lambda: self.forward_s(self.decodes)) if self.decodes else 0
        )

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median(self, once: Callable[[], float]) -> float:
        once()  # warm-up
        return statistics.median(once() for _ in range(self.args.repeats))

    def forward_s(self, batch: list[ScheduledChunk]) -> float:
        self.sync()
        start = time.perf_counter()
        self.runner.forward(batch)
        self.sync()
        return time.perf_counter() - start

    def steps(self, start: int, tokens: int, present: bool) -> list[list[ScheduledChunk]]:
        """The worker's steps that compute ``tokens`` tokens of the request from ``start``."""
        others = self.decodes if present else []
        batches, pos = [], start
        for size in prefill_steps(tokens, self.args.budget, len(others)):
            batches.append([*others, ScheduledChunk(self.ids[:size], pos, self.table)])
            pos += size
        return batches

    def recompute_s(self, tokens: int, context: int, present: bool, suffix: int) -> float:
        """Marginal seconds of recomputing ``tokens`` after ``context`` (see the module doc)."""
        with_range = self.steps(context, tokens + suffix, present)
        without = self.steps(context + tokens, suffix, present) if suffix else []
        extra = len(with_range) - len(without) if present else 0

        def once() -> float:
            spent = sum(self.forward_s(batch) for batch in with_range)
            spent -= sum(self.forward_s(batch) for batch in without)
            return spent - sum(self.forward_s(self.decodes) for _ in range(extra))

        return max(self.median(once), 0.0)

    def move_s(self, pairs: list[tuple[int, int]], to_cpu: bool, present: bool) -> float:
        """Seconds of one swap (``(gpu, cpu)`` pairs), while the present batch keeps the GPU
        busy: decode steps enqueued for several times the swap's calibrated time."""
        cal = self.calibration
        line = (cal.swap_out if to_cpu else cal.swap_in) if cal else None
        predicted = line.seconds(len(pairs)) if line else 1e-3
        move = self.pools.swap_out if to_cpu else self.pools.swap_in
        moved = pairs if to_cpu else [(c, g) for g, c in pairs]
        return self.timed_beside(lambda: move(moved), predicted, present)

    def peer_s(self, context: int, blocks: int, present: bool) -> float:
        """Seconds of copying ``blocks`` scattered blocks of the peer pool into the range after
        ``context`` (``PeerCopier.copy``, as the daemon), beside the present batch as a swap."""
        assert self.peer is not None and self.copy_line is not None
        first = context // BLOCK
        sources = random.Random(blocks).sample(range(self.peer.pool.shape[0]), blocks)
        pairs = list(zip(sources, self.table[first : first + blocks], strict=True))
        return self.timed_beside(
            lambda: self.copier.copy(1, 0, pairs), self.copy_line.seconds(blocks), present
        )

    def timed_beside(self, run: Callable[[], float], predicted: float, present: bool) -> float:
        """Median seconds of ``run`` while the present batch keeps the GPU busy (decode steps
        enqueued for several times ``predicted``)."""

        def once() -> float:
            self.sync()
            if not present or self.device.type != "cuda":
                return run()
            for factor in (3, 12, 48):  # more decode steps until they outlast the run
                self.busy(factor * predicted + 1e-3)
                seconds = run()
                covered = not torch.cuda.current_stream(self.device).query()
                self.sync()
                if covered:
                    break
            return seconds

        return self.median(once)

    def busy(self, seconds: float) -> None:
        """Enqueues the present batch's decode steps for about ``seconds`` of device time."""
        count = min(math.ceil(seconds / max(self.decode_step_s, 1e-5)) + 1, 2000)
        self.runner.forward(self.decodes)  # loads the decode graph's inputs (or runs eagerly)
        graphs = self.runner.graphs
        for _ in range(count - 1):
            if graphs is not None and len(self.decodes) <= graphs.max_batch:
                graphs.replay(len(self.decodes))
            else:
                self.runner.forward(self.decodes)

    def pairs(self, context: int, blocks: int) -> list[tuple[int, int]]:
        """(GPU, CPU) ids of the range after ``context``: CPU ids consecutive, as ``calibrate``."""
        first = context // BLOCK
        return list(zip(self.table[first : first + blocks], range(blocks), strict=True))


def build_model(args: argparse.Namespace) -> PreTrainedModel:
    """The worker's model: ``tiny`` on CPU (``load_model``); on CUDA a random bf16 Llama
    (``bench.shapes``' configs, initialised on the GPU: minutes faster for 8b), fused as a
    worker fuses it."""
    if args.device == "cpu":
        from compute.model.models import load_model

        return load_model("tiny", "auto", "cpu")[0]
    from transformers import AutoModelForCausalLM

    from bench.shapes import SHAPES
    from compute.model.fused import fuse_layers

    config = SHAPES[args.shape]()
    config.max_position_embeddings = max(config.max_position_embeddings, longest(args) + BLOCK)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation="paged", dtype=torch.bfloat16
        )
    fuse_layers(model.eval())
    return model


def longest(args: argparse.Namespace) -> int:
    """Tokens of the swept request at most: its context, the range and its suffix."""
    grid = max(args.contexts) + max(args.blocks) * BLOCK + max(args.suffixes)
    seeds = max(args.seed_contexts) + max(args.seed_tokens) if args.recalibrate else 0
    return max(grid, seeds)


def note(text: str) -> None:
    print(f"# {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)
