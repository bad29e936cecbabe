"""What rank 0 of a tensor-parallel group sends the other ranks before each call on its model
runner, so that every rank runs the same forward on its own shards and its own KV pool: the
protocol between the ranks of one worker group.

One ``StepPlan`` per call (``map``: the kvstore's pool, every rank's, and the runner's
settings, sent whenever rank 0 maps a pool; ``forward``: the step's chunks, and which chunks
take their token from the device; ``copy``: copy-on-write block copies; ``stop``), encoded with
msgspec (no pickle) and broadcast over the group as bytes: its length, then its bytes. A
forward's fed tokens (drawn on the device by the step before: the overlap of host and device
work) follow as one device tensor broadcast from rank 0, so no rank waits for the host to see
them.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch
import torch.distributed as dist

from compute.parallel.layers import TPGroup
from kvstore.protocol import PoolInfo

__all__ = [
    "PlannedChunk",
    "RunnerSettings",
    "StepPlan",
    "broadcast_fed",
    "receive_plan",
    "send_plan",
]

PlanKind = Literal["map", "forward", "copy", "stop"]


class PlannedChunk(msgspec.Struct, frozen=True, array_like=True):
    """A ``ScheduledChunk`` of the step (the runner's record of one request's share)."""

    token_ids: list[int]
    start: int
    block_ids: list[int]
    every_row: bool = False
    key: str | None = None


class RunnerSettings(msgspec.Struct, frozen=True):
    """What a rank's ``ModelRunner`` is built with besides its model and pool."""

    block_size: int
    cuda_graph_max_batch: int
    cuda_graph_max_tokens: int
    max_chunks: int


class StepPlan(msgspec.Struct, frozen=True):
    """``map``: ``pool`` (its ``ranks``: each rank's) and ``settings``; ``forward``: ``chunks``,
    of which ``fed_chunks[i]`` takes row ``fed_rows[i]`` of the fed tensor (``fed_len`` rows,
    broadcast next); ``copy``: ``copies`` as ``(src, dst)`` blocks; ``stop``: the group ends."""

    kind: PlanKind
    chunks: list[PlannedChunk] = []
    fed_len: int = 0
    fed_rows: list[int] = []
    fed_chunks: list[int] = []
    copies: list[tuple[int, int]] = []
    pool: PoolInfo | None = None
    settings: RunnerSettings | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepPlan)


def send_plan(plan: StepPlan, group: TPGroup, device: torch.device) -> None:
    """Rank 0: broadcasts ``plan`` (its length, then its bytes) from tensors on ``device``
    (the group's backend's: CUDA for NCCL, CPU for gloo)."""
    payload = _ENCODER.encode(plan)
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(length, 0, group=group.group)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    dist.broadcast(data, 0, group=group.group)


def receive_plan(group: TPGroup, device: torch.device) -> StepPlan:
    """Another rank: the plan rank 0 sent next."""
    length = torch.empty(1, dtype=torch.int64, device=device)
    dist.broadcast(length, 0, group=group.group)
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, 0, group=group.group)
    return _DECODER.decode(data.cpu().numpy().tobytes())


def broadcast_fed(
    source: torch.Tensor | None, rows: int, group: TPGroup, device: torch.device
) -> torch.Tensor:
    """The fed tokens: rank 0's ``source`` ([rows] int64 on the device), on every rank."""
    if source is None:
        source = torch.empty(rows, dtype=torch.int64, device=device)
    dist.broadcast(source, 0, group=group.group)
    return source
