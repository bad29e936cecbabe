"""The kvstore protocol's version, limits and closed code sets, and its two kinds of Struct: a
tagged message body (``_Msg``) and an untagged part of one (``_Item``). Part of
``kvstore.protocol``, which every user imports."""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 11  # 2: Call.token; the wire's codes and kinds are closed sets (Literal).
# 3: AdmitItem.reuse_prefix, Step.finals. 4: the CPU prefix tier (Stats fields, DecisionRow.kind,
# GetBlockMap, GetBlockInfo, Step.timeline, WorkerRow.timeline). 5: Register.recompute_profile
# and .graph_token_buckets, WorkerRow.recompute_profile. 6: LOOKAHEAD_SLOTS.
# 7: StepTimeline.held_steps. 8: Register.profile_origin, WorkerRow.profile_origin.
# 9: Step.copied. 10: pools (Register.pool, Route, Routed, Stats.pools, Pong.pools, the pool of
# GetBlockMap and GetBlockInfo, the "copy" mode and "peer" kind of decisions). 11: Route.book.

# A running request's block table holds the slots of its known tokens and of this many after
# them: a worker may compute that many tokens the kvstore has not heard of yet (sampled tokens
# fed from the device, in a step launched before the reply to its last report is applied).
LOOKAHEAD_SLOTS = 2

# The daemon's default --lease-timeout-s, its failure detector: a worker silent this long (it
# sends a Step every engine step, every 100 ms when idle) is dead, and others may adopt its
# requests; workers take a dead one's requests over in Redis after as long (compute/loop/intake.py).
LEASE_TIMEOUT_S = 6.0

PoolKind = Literal["shm", "cuda_ipc"]
ErrorCode = Literal["bad_message", "version", "unauthorized", "unknown_worker", "internal"]
ItemOp = Literal["cost", "fork", "final", "free", "preempt", "append", "resume", "admit"]
ItemCode = Literal[
    "no_space",  # not now: the request waits (for an append, the worker preempts)
    "too_large",  # never: more blocks than the pool can give one request
    "unknown_request",
    "duplicate_request",
    "not_owner",
    "wrong_state",
    "conflict",  # an adopt of a request that a live worker still holds
    "bad_argument",
]
PreemptMode = Literal["swap", "recompute"]
# What a decision chose: a preemption swaps or drops; a prefix hit in the CPU tier loads the
# blocks back ("load") or lets the worker recompute their tokens ("recompute").
# A prefix cached in another GPU's pool is copied over ("copy") or recomputed.
DecisionMode = Literal["swap", "recompute", "load", "copy"]
DecisionKind = Literal["preempt", "prefix", "peer"]
# How the gateway places a request on one of the host's pools (``kvstore.placement``).
RoutingPolicy = Literal["prefix", "round_robin", "least_loaded"]
# How a routed request's cached prefix reaches its pool: it is there, it is copied from another
# pool's GPU, it is loaded from a CPU tier (the pool's own or another's), it is recomputed, or
# nothing is cached anywhere.
Bring = Literal["cached", "copy", "load", "recompute", "none"]
# One byte per block in ``BlockMap``: what the block holds now.
BlockState = Literal["free", "running", "cached", "swapped", "demoted"]
BLOCK_STATES: tuple[BlockState, ...] = ("free", "running", "cached", "swapped", "demoted")
RequestStatus = Literal["running", "swapped", "dropped"]
Tier = Literal["gpu", "cpu"]
# Where a worker's cost-model profile came from: timed at this start-up, read from its on-disk
# cache, or none at all (the kvstore prices by its priors).
ProfileSource = Literal["measured", "cached", "prior"]


class _Msg(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag=True):
    """A message body: tagged with its class name."""


class _Item(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """A part of a body (untagged, not tracked by the GC: half the codec time of a body)."""
