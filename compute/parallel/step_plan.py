"""What rank 0 of a tensor-parallel group sends the other ranks before each call on its model
runner, so that every rank runs the same forward on its own shards and its own KV pool: the
protocol between the ranks of one worker group.

One ``StepPlan`` per call (``map``: the kvstore's pool, every rank's, and the runner's
settings, sent whenever rank 0 maps a pool; ``forward``: the step's chunks, and which chunks
take their token from the device; ``copy``: copy-on-write block copies; ``stop``), encoded with
msgspec (no pickle) and written into the group's plan ring in shared memory (``TPGroup.plans``,
``compute.parallel.plan_ring``): rank 0 writes and goes on, and a rank reads its next plan while
its GPU still runs the step before (a broadcast over NCCL would reach the host only once the
rank's stream had drained; one over gloo held rank 0 until every rank was ready). A forward's
fed tokens (drawn on the device by the step before: the overlap of host and device work) follow
as one device tensor broadcast from rank 0 over the device group, so no rank waits for the host
to see them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import torch
import torch.distributed as dist

from compute.parallel.layers import TPGroup
from kvstore.protocol import PoolInfo

__all__ = [
    "PlannedChunk",
    "RunnerSettings",
    "ScratchPool",
    "StepPlan",
    "TableMirror",
    "broadcast_fed",
    "decode_plan",
    "encode_plan",
    "receive_plan",
    "send_plan",
]

PlanKind = Literal["map", "scratch", "forward", "copy", "release", "stop"]


class PlannedChunk(msgspec.Struct, frozen=True, array_like=True):
    """A ``ScheduledChunk`` of the step (the runner's record of one request's share), its block
    table as a change (``TableMirror``): the first ``kept`` blocks of the table its ``key`` had
    in the forward plan before, then ``blocks``."""

    token_ids: list[int]
    start: int
    kept: int
    blocks: list[int]
    every_row: bool = False
    key: str | None = None


class TableMirror:
    """The block tables of the last forward plan, by sequence key. Rank 0 keeps one to send each
    table as its change since that plan (``plan``: mostly nothing, or one block appended), every
    other rank one to rebuild the tables (``tables``); both forget the keys a plan leaves out.
    A 256-decode step of 1k-token contexts is then ~2k integers, not ~17k."""

    def __init__(self) -> None:
        self._last: dict[str, list[int]] = {}

    def plan(
        self, chunks: Sequence[tuple[Sequence[int], int, Sequence[int], bool, str | None]]
    ) -> list[PlannedChunk]:
        """Rank 0: the planned chunks of ``(token_ids, start, block_ids, every_row, key)``."""
        last, now = self._last, {}
        planned = []
        for token_ids, start, block_ids, every_row, key in chunks:
            table = list(block_ids)  # a copy: the caller's list grows in place
            kept = 0
            if key is not None:
                old = last.get(key)
                if old is not None and table[: len(old)] == old:
                    kept = len(old)
                now[key] = table
            planned.append(PlannedChunk(list(token_ids), start, kept, table[kept:], every_row, key))
        self._last = now
        return planned

    def tables(self, planned: Sequence[PlannedChunk]) -> list[list[int]]:
        """Another rank: each planned chunk's whole block table."""
        last, now = self._last, {}
        tables = []
        for chunk in planned:
            table = chunk.blocks
            if chunk.key is not None:
                if chunk.kept:
                    table = last[chunk.key][: chunk.kept] + chunk.blocks
                now[chunk.key] = table
            tables.append(table)
        self._last = now
        return tables


class RunnerSettings(msgspec.Struct, frozen=True):
    """What a rank's ``ModelRunner`` is built with besides its model and pool."""

    block_size: int
    cuda_graph_max_batch: int
    cuda_graph_max_tokens: int
    max_chunks: int
    token_buckets: list[int] = []  # of the graphs of mixed steps (default: every bucket)


class ScratchPool(msgspec.Struct, frozen=True):
    """A pool of the rank's own, never the kvstore's, holding ``tokens`` tokens (``zeroed``, or
    left as allocated), and the runner over it: what the cost-model profile times forwards on."""

    tokens: int
    zeroed: bool
    settings: RunnerSettings


class StepPlan(msgspec.Struct, frozen=True):
    """``map``: ``pool`` (its ``ranks``: each rank's) and ``settings``; ``scratch``: a runner
    over a ``scratch`` pool until ``release``; ``forward``: ``chunks``, of which
    ``fed_chunks[i]`` takes row ``fed_rows[i]`` of the fed tensor (``fed_len`` rows, broadcast
    next); ``copy``: ``copies`` as ``(src, dst)`` blocks; ``stop``: the group ends."""

    kind: PlanKind
    chunks: list[PlannedChunk] = []
    fed_len: int = 0
    fed_rows: list[int] = []
    fed_chunks: list[int] = []
    copies: list[tuple[int, int]] = []
    pool: PoolInfo | None = None
    settings: RunnerSettings | None = None
    scratch: ScratchPool | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepPlan)


def encode_plan(plan: StepPlan) -> bytes:
    return _ENCODER.encode(plan)


def decode_plan(payload: bytes) -> StepPlan:
    return _DECODER.decode(payload)


def send_plan(plan: StepPlan, group: TPGroup) -> None:
    """Rank 0: writes ``plan`` into the group's plan ring (returns once it is written)."""
    assert group.plans is not None, "a group without a plan ring"
    group.plans.send(encode_plan(plan))


def receive_plan(group: TPGroup) -> StepPlan:
    """Another rank: the plan rank 0 sent next (waits for it on the host only)."""
    assert group.plans is not None, "a group without a plan ring"
    return decode_plan(group.plans.receive())


def broadcast_fed(
    source: torch.Tensor | None, rows: int, group: TPGroup, device: torch.device
) -> torch.Tensor:
    """The fed tokens: rank 0's ``source`` ([rows] int64 on the device), on every rank."""
    if source is None:
        source = torch.empty(rows, dtype=torch.int64, device=device)
    dist.broadcast(source, 0, group=group.group)
    return source
