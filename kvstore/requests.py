"""The kvstore's per-request records and the results the manager hands out. Pure Python.

``Request`` is owned and mutated by ``KVCacheManager`` alone; ``Placement``, ``Growth`` and
``TransferPlan`` are what it returns to its caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from kvstore.protocol import LOOKAHEAD_SLOTS, ItemCode


class KVError(Exception):
    """A per-request failure; ``code`` is one of the protocol's item error codes."""

    def __init__(self, code: ItemCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Status(Enum):
    RUNNING = "running"
    SWAPPED = "swapped"  # bytes in the CPU tier
    DROPPED = "dropped"  # preempted for recompute: no blocks


@dataclass
class Request:
    req_id: str
    worker: str
    salt: bytes | None
    token_ids: list[int]
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)  # GPU blocks while running
    cpu_block_ids: list[int] = field(default_factory=list)  # while swapped
    contents: list[bytes] = field(default_factory=list)  # content hash per full known block
    keys: list[bytes] = field(default_factory=list)  # prefix-index key per full known block
    num_registered: int = 0  # leading computed full blocks already offered to the index
    status: Status = Status.RUNNING
    num_cached_tokens: int = 0
    preemptions: int = 0
    decision_id: int | None = None
    orphaned_at: float | None = None
    reuse_prefix: bool = True  # False: placed without a prefix lookup (prompt logprobs)


class Placement(NamedTuple):
    """A request's block table after admit/resume/adopt; the worker computes from num_computed."""

    req_id: str
    block_ids: list[int]
    num_computed: int
    num_cached_tokens: int


class Growth(NamedTuple):
    """What an append changed: blocks added at the table's end, and copy-on-write replacements
    ``(position in the table, src block, dst block)`` whose copy the caller performs first."""

    req_id: str
    new_block_ids: list[int]
    copies: list[tuple[int, int, int]]


@dataclass
class TransferPlan:
    """Block copies between tiers for the daemon to run: ``(gpu block, cpu block)`` pairs."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)
    decisions: dict[int, int] = field(default_factory=dict)  # decision id -> blocks moved


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def table_blocks(num_tokens: int, block_size: int) -> int:
    """The blocks a running request's table holds: the slots of its ``num_tokens`` known tokens
    and of the ``protocol.LOOKAHEAD_SLOTS`` after them. A worker feeds the token it samples to
    its next step from the device, before it reports it, and launches that step before the
    kvstore's reply to its last report is applied (``compute.loop.engine``): two tokens past what
    the kvstore knows, whose slots must be in the table already, also when they begin a block, so
    that no sequence waits a step at a block boundary."""
    return cdiv(num_tokens + LOOKAHEAD_SLOTS, block_size)
